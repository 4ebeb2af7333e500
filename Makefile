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

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml setup.py $(wildcard sglang_ext/kernels/*.cpp sglang_ext/kernels/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
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

# Optional llama.cpp peer for `moa-serve bench` (not in requirements.txt: it compiles for ~20 min).
# The default native build segfaults on this VM; these flags build a portable AVX2/AVX-512 one.
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
bench-peers: install
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=1 $(PY) -m pip install llama-cpp-python==0.3.36

clean:
	rm -rf $(VENV) results

include deploy/check.mk
