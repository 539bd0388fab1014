# Quick start: `make demo`, `make test`. Both create .venv when it is missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# Ray binds to 127.0.0.1 only when this is set before it starts.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: demo test bench install clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/loomray demo

test: $(VENV)/.installed
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(VENV)/.installed
	$(PY) bench/storage_bench.py
	@for b in bench/loop_bench.py bench/ray_bench.py; do test ! -f $$b || $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache loomray-data bench/results
