# Two commands do all setup on a fresh machine:
#   make serve   creates .venv, installs corestream, runs the cluster on the tiny model
#   make test    creates .venv, installs the dev tools, runs the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
BUF_VERSION := 1.75.0
BUF := .tools/buf/node_modules/.bin/buf
ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test test-slow lint protos check-protos buf check clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch is pinned: other versions pull a multi-GB CUDA build.
$(VENV)/.serve-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) -e '.[engine]'
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(VENV)/bin/python
	$(PIP) -e '.[dev]'
	touch $@

serve: $(VENV)/.serve-installed
	$(VENV)/bin/corestream serve $(ARGS)

test: $(VENV)/.dev-installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

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

check: lint check-protos buf

clean:
	rm -rf $(VENV) .tools .pytest_cache .ruff_cache
