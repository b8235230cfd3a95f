# The gateway image: HTTP API, batching, the drafter/verifier clients; no model work in
# services mode, so no compiler and no checkpoints (CPU torch only: tensors on the wire).
# Also runs the model-store Job and init containers (lyanna fetch-model).
#   docker build -f deploy/images/gateway.Dockerfile -t .../lyanna-gateway .
# Pin the base by digest when you build for production: BASE=python:3.11-slim@sha256:<digest>
ARG BASE=python:3.11-slim
FROM ${BASE}
ENV PYTHONUNBUFFERED=1 LYANNA_CACHE=/models HOME=/tmp
WORKDIR /build
COPY pyproject.toml README.md ./
COPY lyanna lyanna
COPY gateway gateway
COPY remote_engine remote_engine
COPY services services
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install --no-cache-dir . \
    && cd / && rm -rf /build
WORKDIR /
USER 65532:65532
EXPOSE 8000
CMD ["lyanna", "serve", "--mode", "services", "--host", "0.0.0.0"]
