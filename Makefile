# sglang-pacer: the two commands the README promises.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

## run: the proxy in front of a simulated SGLang worker (policies/default.toml)
run: $(STAMP)
	$(VENV)/bin/pacer serve --policy policies/default.toml

## test: every test, the slow real-engine ones included
test: $(STAMP)
	$(PY) -m pytest -q

## test-fast: everything but the slow real-engine tests
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
