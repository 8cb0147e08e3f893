# kvxferd sidecar image. Multi-stage: build a venv, copy it into a slim runtime as non-root.
FROM python:3.11-slim AS build
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first (CPU wheel index); kvxferd only needs its runtime pieces for DRAM/VRAM registration.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY kvxferd ./kvxferd
RUN pip install --no-cache-dir .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 kvxferd
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    UCX_NET_DEVICES=all \
    PYTHONUNBUFFERED=1
USER kvxferd
EXPOSE 7600
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:7600/healthz', timeout=2)" || exit 1
ENTRYPOINT ["kvxferd", "serve"]
CMD ["--peer-port", "7600"]
