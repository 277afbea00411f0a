# radixmesh node, CPU image with the built-in engine (`--preset tiny` by default: seeded random
# weights and a byte tokenizer, so nothing is downloaded at run time).
#
#   docker build -t radixmesh:cpu .
#   docker run --rm -p 8000:8000 radixmesh:cpu                  # one node, alone
#   docker run ... radixmesh:cpu --advertise 10.0.0.1:8000 --join 10.0.0.2:8000
#
# The entrypoint binds 0.0.0.0:8000, and a node bound to 0.0.0.0 must be told which address its
# peers reach it at: the orchestrator passes `--advertise`, e.g. `--advertise $(POD_IP):8000`
# in Kubernetes (POD_IP from the downward API) or `--advertise n1:8000` (the service name) in
# Compose; see deploy/. The default CMD advertises 127.0.0.1:8000, which only suits a node
# alone; any arguments given replace it, so a mesh node always passes its own --advertise.
# The cluster key comes from the RADIXMESH_CLUSTER_KEY environment variable (never a flag:
# flags show in ps).
#
# GPU image: the same steps on a CUDA runtime base, with the CUDA build of torch that matches
# the host's driver instead of the CPU one, and `--device cuda`:
#
#   FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04     # a CUDA version the host driver supports
#   RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
#       && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv
#   ENV PATH=/opt/venv/bin:$PATH
#   RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
#   ... then the same COPY / `pip install .` / user / HEALTHCHECK steps as below, and
#   CMD ["--device", "cuda", "--advertise", "127.0.0.1:8000"]
#
# and run it with `docker run --gpus all ...` (Compose: `deploy.resources.reservations.devices`;
# Kubernetes: `resources.limits: {nvidia.com/gpu: 1}`, with the NVIDIA device plugin).

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MPLCONFIGDIR=/tmp/matplotlib

# torch first, from the CPU index: the package leaves torch unpinned, and an unpinned torch
# from PyPI pulls a multi-GB CUDA build. Its own layer, so code changes do not re-download it.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install . && rm -rf /src

RUN useradd --create-home --uid 10001 --user-group radixmesh
USER 10001:10001
WORKDIR /home/radixmesh

EXPOSE 8000
# SIGTERM drains: the node stops taking work, tells its peers, finishes what is in flight within
# --drain-grace (default 30s), then exits 0. Give the orchestrator's kill timeout more than that.
STOPSIGNAL SIGTERM
# /health answers 503 while the node drains, so it reads unhealthy then (urlopen raises).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["radixmesh", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--advertise", "127.0.0.1:8000"]
