# sglang-pacer: the two commands the README promises.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast lint format bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench,fleet]'
	touch $(STAMP)

## run: the proxy in front of a simulated SGLang worker (policies/default.toml)
run: $(STAMP)
	$(VENV)/bin/pacer serve --policy policies/default.toml

## lint: ruff (lint and format), mypy (strict on proxy/) and the import contracts (pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

## format: let ruff fix what it can and format the tree
format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

## test: the checks above, then every test, the slow real-engine ones included
test: lint
	$(PY) -m pytest -q

## test-fast: the checks, then everything but the slow real-engine tests
test-fast: lint
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
