# kvxferd sidecar image. Multi-stage: build a venv, copy only it into a slim runtime, run as
# non-root. Build: `docker build -t kvxferd:0.1.0 .`; for VRAM (CUDA IPC) pools build the CUDA
# torch: `docker build --build-arg TORCH_VARIANT=cu128 -t kvxferd:0.1.0-cu128 .`.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from its own index: the `torch>=2.4` requirement is then satisfied and pip never
# pulls the default CUDA wheels on top of the variant chosen here.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
COPY pyproject.toml README.md ./
COPY kvxferd ./kvxferd
RUN pip install --no-cache-dir . \
    && find /opt/venv -name '__pycache__' -type d -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvxferd" \
      org.opencontainers.image.description="KV-cache transfer sidecar for P/D LLM serving (NIXL)" \
      org.opencontainers.image.licenses="Apache-2.0"
# uid/gid 10001: the securityContext in deploy/k8s runs as this numeric user.
RUN groupadd --gid 10001 kvxferd \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin kvxferd \
    && install -d -o 10001 -g 10001 -m 0700 /run/kvxferd
COPY --from=build /opt/venv /opt/venv
# UCX_NET_DEVICES=all: let UCX pick RDMA NICs; pin it per cluster (deploy/README.md, UCX).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    UCX_NET_DEVICES=all \
    KVXFERD_PEER_HOST=0.0.0.0 \
    KVXFERD_PEER_PORT=7600 \
    KVXFERD_PEER_FRAMES_PORT=7601 \
    KVXFERD_ENGINE_SOCKET=/run/kvxferd/engine.sock
USER 10001:10001
WORKDIR /tmp
# 7600: peer API (handshake, claims, heartbeat) plus /metrics, /healthz, /readyz; 7601: the
# per-pull peer calls as signed frames.
EXPOSE 7600 7601
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('KVXFERD_PEER_PORT', '7600'), timeout=2)"]
ENTRYPOINT ["kvxferd", "serve"]
