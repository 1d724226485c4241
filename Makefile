# Quick start: `make demo` runs the demo, `make test` runs the whole test suite.
# Each target creates .venv and installs the pinned dependencies when needed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-no-amx lint bench venv clean

$(STAMP): requirements.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -r requirements.lock
	$(PY) -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m jreshard demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The suite as on an x86 CPU without AMX (AVX-512 kept): tests/isa/no_amx/sitecustomize.py.
test-no-amx: $(STAMP)
	PYTHONPATH=$(CURDIR)/tests/isa/no_amx $(PY) -m pytest -q $(PYTEST_ARGS)

# The same checks tests/test_quality.py runs, with their full output.
lint: $(STAMP)
	@status=0; $(VENV)/bin/ruff check || status=1; $(VENV)/bin/mypy || status=1; \
	  $(VENV)/bin/lint-imports || status=1; exit $$status

bench: $(STAMP)
	$(PY) benchmarks/plan_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache .ruff_cache .import_linter_cache
