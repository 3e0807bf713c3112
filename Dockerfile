# syntax=docker/dockerfile:1
#
# One image, one entrypoint: `corestream`. The model is never baked in; it comes from a
# volume (`--model /models/<path>`), or the services write their tiny test checkpoint
# under $CORESTREAM_CACHE_DIR.
#
#   docker build --build-arg VARIANT=slim -t corestream:0.1.0-slim .   # frontend, coordinator
#   docker build --build-arg VARIANT=cpu  -t corestream:0.1.0-cpu  .   # + engine on CPU
#   docker build --build-arg VARIANT=cuda -t corestream:0.1.0-cuda .   # + engine on CUDA
#
# slim has no torch (the frontend and coordinator never import it); cpu installs torch from
# the CPU wheel index; cuda installs torch's default (CUDA) wheels, which carry their own
# CUDA libraries, and the `gpu` extra (triton, cupy for NCCL) on an nvidia/cuda runtime
# base. Pin the bases by digest in release builds:
#   --build-arg PYTHON_IMAGE=python:3.12.12-slim-bookworm@sha256:...

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04

# ---- bases: the same stage builds the virtualenv and runs it, so its python links hold.
FROM ${PYTHON_IMAGE} AS base-python
ENV CORESTREAM_PYTHON=/usr/local/bin/python3

FROM base-python AS base-slim

FROM base-python AS base-cpu
# The engine compiles its CPU paged-attention kernel with -march=native on the node it
# runs on (a build made here could SIGILL elsewhere), so the CPU image keeps a compiler;
# without one the engine logs a warning and uses the slower torch path.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

FROM ${CUDA_IMAGE} AS base-cuda
# Ubuntu 24.04's own python3.12; versions float with the pinned base image's snapshot.
# Triton compiles its kernel launchers at run time: a C compiler and Python.h stay in.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
       python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV CORESTREAM_PYTHON=/usr/bin/python3.12

# A stage chosen by VARIANT, not a registry image, so it has no tag.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS base

# ---- build: a virtualenv with corestream and, except for slim, torch.
FROM base AS build
ARG VARIANT
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN "${CORESTREAM_PYTHON}" -m venv /opt/corestream
ENV PATH=/opt/corestream/bin:$PATH
WORKDIR /src
# Dependencies first, so that a source change does not reinstall torch.
COPY pyproject.toml README.md ./
RUN case "${VARIANT}" in \
      cpu) pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 ;; \
      cuda) pip install torch==2.13.0 ;; \
      slim) ;; \
      *) echo "VARIANT must be slim, cpu or cuda, not ${VARIANT}" >&2; exit 1 ;; \
    esac
COPY services ./services
COPY kernels ./kernels
COPY protos ./protos
# The project itself (its dependencies are pinned in pyproject.toml), which hadolint
# cannot tell from an unpinned package name.
# huggingface_hub: only the chart's model-download Job uses it; the services never do.
# hadolint ignore=DL3013
RUN case "${VARIANT}" in \
      slim) target=. ;; \
      cpu) target=".[engine]" ;; \
      cuda) target=".[engine,gpu]" ;; \
    esac \
    && pip install "${target}" "huggingface_hub>=0.34,<3" \
    && pip check

# ---- runtime: the virtualenv, a non-root user and nothing else.
FROM base AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="corestream" \
      org.opencontainers.image.description="LLM serving cluster of gRPC services (${VARIANT})" \
      org.opencontainers.image.source="https://github.com/corestream/corestream"
RUN groupadd --system --gid 10001 corestream \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/corestream \
       --create-home --shell /usr/sbin/nologin corestream
COPY --from=build /opt/corestream /opt/corestream
# Writable state goes to the cache dir (an emptyDir in Kubernetes, where the root
# filesystem is read-only): the tiny checkpoint, torch's and triton's JIT builds.
ENV PATH=/opt/corestream/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/corestream \
    CORESTREAM_CACHE_DIR=/var/cache/corestream \
    TORCH_EXTENSIONS_DIR=/var/cache/corestream/torch_extensions \
    TRITON_CACHE_DIR=/var/cache/corestream/triton
RUN install -d -o 10001 -g 10001 /var/cache/corestream /models
USER 10001:10001
WORKDIR /home/corestream
EXPOSE 50050 50051 50061
ENTRYPOINT ["corestream"]
CMD ["--help"]
