# Quick start: `make demo`, `make test`. Both create .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# Ray binds to 127.0.0.1 only when this is set before it starts.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: demo test lint soak fuzz chaos bench install clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/loomray demo

# Two workers (pytest-xdist), each given whole test modules (loadfile): a module's Ray cluster, moto server or
# browser starts once, in one worker; tests/conftest.py keeps the modules in collection order.
test: $(VENV)/.installed
	bash .ci/ensure-browser
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

# Lint and types: ruff (style, imports, no private-name imports) and mypy over the library packages.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check loomray storage tests bench examples cluster
	$(VENV)/bin/mypy

# Fault-injection soak: `make soak SEEDS=2000` runs seeds 0..1999 over memory, local and S3 (moto) stores;
# a failing seed prints the one command that replays it, e.g. `make soak SEED=1234 SCENARIO=zombie BACKEND=local`.
SEEDS ?= 200
soak: $(VENV)/.installed
	PYTHONHASHSEED=0 $(PY) tests/durability/soak.py $(if $(SEED),--seed $(SEED),--seeds $(SEEDS))$(if $(SCENARIO), --scenario $(SCENARIO))$(if $(BACKEND), --backend $(BACKEND))$(if $(JOBS), --jobs $(JOBS))

# Chaos checker on a real local Ray cluster: `make chaos SEEDS=20` runs seeds 0..19 (about 20 s each: kept out
# of `make test`); a failing seed prints its replay command, e.g. `make chaos SEED=7`.
chaos: $(VENV)/.installed
	$(PY) tests/chaos/chaos.py $(if $(SEED),--seed $(SEED),--seeds $(SEEDS))

# Hostile-bucket fuzzer: `make fuzz SEEDS=5000` runs seeds 0..4999 (a quarter on a local directory, the rest in
# memory); a failing seed prints the one command that replays it, e.g. `make fuzz SEED=1234 BACKEND=local`.
fuzz: $(VENV)/.installed
	$(PY) tests/fuzz/run.py $(if $(SEED),--seed $(SEED),--seeds $(SEEDS))$(if $(BACKEND), --backend $(BACKEND))$(if $(JOBS), --jobs $(JOBS))

bench: $(VENV)/.installed
	$(PY) bench/storage_bench.py
	@for b in bench/loop_bench.py bench/ray_bench.py; do test ! -f $$b || $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache loomray-data bench/results
