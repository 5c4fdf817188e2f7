# Two commands on a fresh machine: `make demo` and `make test`. Each creates or reuses .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo check test bench docs clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[tools,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/partime demo

check: $(STAMP)
	$(BIN)/ruff check src tests examples experiments benchmarks mkdocs_hooks.py
	$(BIN)/ruff format --check src tests examples experiments benchmarks mkdocs_hooks.py
	$(BIN)/mypy

test: check
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/partime bench --sizes

docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build dist site src/*.egg-info
