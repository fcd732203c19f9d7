# foretoken: every command sets up what it needs first (a venv with the project installed;
# the local Kafka broker for test, demo and bench). See README.md.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NATIVE_STAMP := $(VENV)/.native-installed
# The native crate (native/: the index, the content hash, the queue walk) builds with cargo
# from crates.io; two jobs by default (a shared 2-core machine), the target dir is kept
# (native/target), so a rebuild after a change is incremental and no change means no build.
export CARGO_BUILD_JOBS ?= 2
CARGO := cd native && PYO3_PYTHON=$(abspath $(BIN)/python) cargo
NATIVE_SOURCES := native/Cargo.toml native/Cargo.lock native/pyproject.toml \
	$(wildcard native/src/*.rs native/src/*/*.rs)

.PHONY: setup llama llama-prebuild aiperf aiperf-background test test-suites unit lint demo bench clean kafka-up kafka-down native-test

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "error: $(PY) (Python >= 3.11) is needed"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

# foretoken_native: a wheel built by maturin (from PyPI) in pip's build environment.
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	@command -v cargo >/dev/null || { echo "error: cargo and rustc (Rust >= 1.85) are needed to build native/"; exit 1; }
	$(BIN)/pip install -q ./native
	@touch $(NATIVE_STAMP)

setup: $(STAMP) $(NATIVE_STAMP)

# llama-cpp-python (the `llama` extra) compiles llama.cpp from PyPI's sdist: built once into
# ~/.cache/foretoken/wheels (foretoken/ops/llama_wheel.py), then installed from there.
llama: setup
	$(BIN)/python -m foretoken.ops.llama_wheel

# NVIDIA aiperf (a benchmark tool, from PyPI) in a venv of its own: its pins (click, rich,
# pandas) clash with faust's. `foretoken bench aiperf` and one integration test use it.
# --no-compile: byte-compiling its 140 packages was half the install's CPU (138 -> 75 s of
# user time from an empty pip cache); the few modules a run imports compile as it starts.
AIPERF_VERSION := 0.13.0
AIPERF_VENV := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed-$(AIPERF_VERSION)
$(AIPERF_STAMP):
	$(PY) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q --upgrade pip
	$(AIPERF_VENV)/bin/pip install -q --no-compile aiperf==$(AIPERF_VERSION)
	@touch $(AIPERF_STAMP)

aiperf: $(AIPERF_STAMP)

# During `make test` aiperf installs in the background at the lowest priority (~2.5 minutes
# of pip's CPU on a fresh machine, needed only by one integration test, which runs last and
# waits for the lock held by the install: foretoken/bench/aiperf_bench.py).
AIPERF_LOCK := .run/aiperf-install.lock
aiperf-background:
	@if [ ! -f $(AIPERF_STAMP) ]; then mkdir -p .run; \
	  nohup nice -n 19 flock $(AIPERF_LOCK) $(MAKE) --no-print-directory aiperf \
	    > .run/aiperf-install.log 2>&1 < /dev/null & \
	  echo "aiperf: installing in the background (log: .run/aiperf-install.log)"; fi

# Unit and integration suites; starts a broker when none answers and stops what it started.
# A llama-cpp-python wheel build, when needed (~9 CPU-minutes), starts first, in the
# background at the lowest priority, so that it overlaps the set-up's downloads and the unit
# suite (one core each); the integration suites, which run several processes, come after the
# unit suite (tests/conftest.py orders them), and the llama.cpp test, last, waits for the build.
test: llama-prebuild setup aiperf-background
	@foretoken/ops/with-kafka.sh --fresh $(MAKE) --no-print-directory test-suites

llama-prebuild: $(STAMP)
	@$(BIN)/python -m foretoken.ops.llama_wheel --background --build-only

# Two pytest processes (pytest-xdist), each taking whole modules: most integration tests wait
# on real processes, a broker and timers (a suite run used ~45% of the 2 cores), so two at a
# time took the integration suites from ~12 to ~8 minutes here. Tests marked `alone` (the
# llama.cpp engine's timing) run afterwards, by themselves.
TEST_PROCESSES ?= 2
test-suites:
	@$(BIN)/python -m foretoken.ops.llama_wheel --background
	$(CARGO) test -q --no-default-features
	$(BIN)/pytest -q -p no:cacheprovider -n $(TEST_PROCESSES) --dist loadfile -m "not alone" \
	  tests native/tests
	$(BIN)/pytest -q -p no:cacheprovider -m alone tests

unit: setup
	$(BIN)/pytest -q -m "not integration" tests native/tests

# The crate's own tests (the pure core: no libpython to link; the binding is tested by
# native/tests and the index contract suites through Python).
native-test: setup
	$(CARGO) test -q --no-default-features

# check_sizes: no tracked *.py, *.rs, *.sql or *.sh over 600 lines (docs/CONVENTIONS.md, rule 7).
lint: setup
	$(BIN)/python -m foretoken.ops.check_sizes
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy foretoken tests
	$(BIN)/lint-imports
	$(CARGO) fmt --check
	$(CARGO) clippy -q --all-targets -- -D warnings

# `make demo ENGINES=llama`: real llama.cpp engines instead of the simulated fleet.
ENGINES ?= sim
demo: setup
	$(if $(filter llama,$(ENGINES)),$(MAKE) llama)
	$(BIN)/foretoken demo --engines $(ENGINES)

bench: setup llama aiperf
	@foretoken/ops/with-kafka.sh $(BIN)/foretoken bench all

kafka-up: setup
	$(BIN)/foretoken kafka up
kafka-down: setup
	$(BIN)/foretoken kafka down

clean:
	rm -rf .run .pytest_cache .mypy_cache .ruff_cache .hypothesis
