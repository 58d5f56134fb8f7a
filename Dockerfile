# GPU image for the two-node lab: the official vLLM image plus Mooncake and this package.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers curl \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/pd-serve
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY connector ./connector
COPY configs ./configs
RUN pip install --no-cache-dir "mooncake-transfer-engine==0.3.13.post1" && pip install --no-cache-dir -e .
ENV PYTHONPATH=/opt/pd-serve MC_LOG_LEVEL=ERROR
ENTRYPOINT []
