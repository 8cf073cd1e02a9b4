# The project image for EKS: pipeline steps, the TrainJob's training pods and the MLflow server.
# NGC's PyTorch image brings CUDA, NCCL, EFA-ready libfabric/aws-ofi-nccl and its own torch (Python 3.12),
# on which nvidia-resiliency-ext >= 0.6 installs. Build and push:
#   docker build -t <account>.dkr.ecr.<region>.amazonaws.com/resilient-train:<tag> .
FROM nvcr.io/nvidia/pytorch:25.10-py3

WORKDIR /opt/resilient-train
COPY pyproject.toml README.md ./
COPY pipelines ./pipelines
COPY components ./components
COPY trainer ./trainer
# No constraints file here: the base image's torch satisfies torch>=2.6 and must not be replaced.
RUN pip install --no-cache-dir "nvidia-resiliency-ext>=0.6" . "psycopg2-binary>=2.9" \
    && python -c "import trainer, components, pipelines, nvidia_resiliency_ext"

# Non-root (the manifests run as 10001 with a read-only root file system; HOME and caches in /tmp).
RUN groupadd --gid 10001 app && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home app
USER 10001
ENV HOME=/tmp HF_HOME=/tmp/hf PYTHONUNBUFFERED=1
