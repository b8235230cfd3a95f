# The verifier and drafter image (one image, two commands: python -m services.verifier |
# services.drafter). CPU wheels by default; for the A800/H800 pools build the CUDA wheels,
# which carry their own CUDA runtime (the node's NVIDIA container toolkit mounts the driver):
#   docker build -f deploy/images/services.Dockerfile \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124 -t .../lyanna-services .
# Pin the base by digest when you build for production: BASE=python:3.11-slim@sha256:<digest>
# (docker buildx imagetools inspect python:3.11-slim prints it).
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# g++ builds the native decoder for 4-bit CPU targets at first start, into a writable folder;
# the committed drafter checkpoints sit outside the (non-editable) installed package
ENV PYTHONUNBUFFERED=1 LYANNA_CACHE=/models HOME=/tmp LYANNA_NATIVE_DIR=/tmp/lyanna-native \
    LYANNA_CHECKPOINTS=/opt/lyanna/checkpoints
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY checkpoints /opt/lyanna/checkpoints
WORKDIR /build
COPY pyproject.toml README.md ./
COPY lyanna lyanna
COPY gateway gateway
COPY remote_engine remote_engine
COPY services services
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0 \
    && pip install --no-cache-dir . \
    && cd / && rm -rf /build
WORKDIR /
USER 65532:65532
EXPOSE 50051 50052 9101 9102
CMD ["python", "-m", "services.verifier", "--host", "0.0.0.0", "--port", "50051"]
