# The TrainJob's training pods (kubernetes.image): NGC PyTorch — CUDA, NCCL and NVIDIA's torch on Ubuntu
# 24.04, whose glibc 2.39 the NVRx >= 0.6 wheels need — plus AWS's EFA installer: libfabric with the EFA
# provider and the aws-ofi-nccl plugin, without which NCCL silently falls back to TCP sockets on EFA nodes.
#   docker build -f docker/trainer.Dockerfile -t <account>.dkr.ecr.<region>.amazonaws.com/resilient-train-trainer:<tag> .
# No kfp here (the pipeline image has it): NGC enforces its own pins through /etc/pip/constraint.txt, and
# kfp's pins fight them. tests/unit/test_images.py resolves trainer-requirements.txt against those pins.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

ARG EFA_INSTALLER_VERSION=1.43.3
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates \
    && curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | tar -xz -C /tmp \
    && cd /tmp/aws-efa-installer \
    # In a container: no kernel module (the node's EFA driver serves it), no limits.conf (memlock comes
    # from containerd; the trainer checks it at start), no self-test (no EFA device at build time).
    && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
    && cd / && rm -rf /tmp/aws-efa-installer /var/lib/apt/lists/*
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    PATH=/opt/amazon/efa/bin:${PATH}

WORKDIR /opt/resilient-train
COPY pyproject.toml README.md ./
COPY docker/trainer-requirements.txt ./docker/
COPY pipelines ./pipelines
COPY components ./components
COPY trainer ./trainer
# Against the base's own constraints: its torch is never replaced. The project itself without its
# pipeline-side dependencies (kfp, mlflow): the trainer does not import them (boto3 it does, for the S3 tier).
RUN pip install --no-cache-dir -c /etc/pip/constraint.txt -r docker/trainer-requirements.txt \
    && pip install --no-cache-dir --no-deps . \
    && python -c "import trainer.job.cli, nvidia_resiliency_ext, torchft.manager, torch; assert torch.cuda.is_available() or True" \
    && test -e /opt/amazon/ofi-nccl/lib/libnccl-net.so -o -e /opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so

RUN groupadd --gid 10001 app && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home app
USER 10001
ENV HOME=/tmp HF_HOME=/tmp/hf PYTHONUNBUFFERED=1
