# sglang-pacer: the two commands the README promises.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

POLICY ?= policies/default.toml
PORT   ?=
URL    ?= http://127.0.0.1:8000

.PHONY: run demo test test-fast lint format bench clean browser postgres

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench,fleet,postgres]'
	touch $(STAMP)

## run: the proxy in front of a simulated SGLang worker (policies/default.toml), controller in auto;
##      the dashboard at http://127.0.0.1:8000/dashboard
run: $(STAMP)
	$(VENV)/bin/pacer serve --policy $(POLICY) $(if $(PORT),--port $(PORT))

## demo: a workload that makes the controller act, against the proxy `make run` started (at $(URL));
##       with none there, it starts one itself with $(POLICY) and stops it at the end
demo: $(STAMP)
	$(VENV)/bin/pacer demo --url $(URL) --start $(POLICY)

## browser: Debian's chromium for the dashboard's browser test (CI runs as root on Debian)
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing chromium (the dashboard's browser test drives it)"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi; }

## postgres: Debian's PostgreSQL server for the shared store's tests (each run starts its own in a
##           temporary directory; CI runs as root on Debian)
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  echo "installing postgresql (the shared store's tests start a server of their own)"; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; fi; }

## lint: ruff (lint and format), mypy (strict on proxy/, tools/ and loadtests/), the import contracts (pyproject.toml)
##       and the house's own checks (tools/): functions over 80 lines, module docstrings over 25,
##       engine names outside the engines; each prints its offenders and fails on one not in tools/allowed/
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m tools.long_functions
	$(PY) -m tools.long_docstrings
	$(PY) -m tools.engine_names

## format: let ruff fix what it can and format the tree
format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

## test: the checks above, then every test (tests/suite.py): those that need no real engine over two
##       processes while the engine environments build, then the slow real-engine ones one at a time
test: lint browser postgres
	$(PY) -m tests.suite

## test-fast: the checks, then everything but the slow real-engine tests and the long end-to-end runs,
##            over up to 4 cores
test-fast: lint browser postgres
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist worksteal -m "not slow and not long"

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
