# The pipeline's own steps (prepare, fingerprint, stage, record, the TrainJob launcher, validate, evaluate,
# finalize), the MLflow server and the FSx preparation Job: CPU only, slim (kubernetes.pipeline_image).
#   docker build -f docker/pipeline.Dockerfile -t <account>.dkr.ecr.<region>.amazonaws.com/resilient-train-pipeline:<tag> .
# The same pins as local and CI installs (constraints.txt); torch's CPU build from PyTorch's CPU index (the
# PyPI wheel is the CUDA build, gigabytes larger). tests/unit/test_images.py resolves these requirements.
FROM python:3.11-slim-bookworm

WORKDIR /opt/resilient-train
COPY pyproject.toml README.md constraints.txt ./
COPY docker/pipeline-requirements.txt ./docker/
COPY pipelines ./pipelines
COPY components ./components
COPY localcluster ./localcluster
COPY trainer ./trainer
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
    && pip install --no-cache-dir -c constraints.txt -r docker/pipeline-requirements.txt \
    && pip check \
    && python -c "import components, localcluster, pipelines, trainer, kfp, kfp.kubernetes, mlflow, psycopg2"

# Non-root, as every pod that uses this image runs (uid/gid 10001; the FSx roots are prepared for it).
RUN groupadd --gid 10001 app && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home app
USER 10001
ENV HOME=/tmp PYTHONUNBUFFERED=1
