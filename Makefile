# foretoken: every command sets up what it needs first (a venv with the project installed;
# the local Kafka broker for test, demo and bench). See README.md.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup llama test unit lint demo bench clean kafka-up kafka-down

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "error: $(PY) (Python >= 3.11) is needed"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

# llama-cpp-python (the `llama` extra) compiles llama.cpp from PyPI's sdist: built once into
# ~/.cache/foretoken/wheels (foretoken/ops/llama_wheel.py), then installed from there.
llama: setup
	$(BIN)/python -m foretoken.ops.llama_wheel

# Unit and integration suites; starts a broker when none answers and stops what it started.
# A llama-cpp-python build, when needed, starts in the background first; the llama.cpp
# integration test (run last) waits for it.
test: setup
	@$(BIN)/python -m foretoken.ops.llama_wheel --background
	@foretoken/ops/with-kafka.sh $(BIN)/pytest -q -p no:cacheprovider tests

unit: setup
	$(BIN)/pytest -q -m "not integration" tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy foretoken tests
	$(BIN)/lint-imports

# `make demo ENGINES=llama`: real llama.cpp engines instead of the simulated fleet.
ENGINES ?= sim
demo: setup
	$(if $(filter llama,$(ENGINES)),$(MAKE) llama)
	$(BIN)/foretoken demo --engines $(ENGINES)

bench: setup llama
	@foretoken/ops/with-kafka.sh $(BIN)/foretoken bench all

kafka-up: setup
	$(BIN)/foretoken kafka up
kafka-down: setup
	$(BIN)/foretoken kafka down

clean:
	rm -rf .run .pytest_cache .mypy_cache .ruff_cache .hypothesis
