# Two commands for a fresh machine (see README.md):
#   make run   - create .venv, install, run the main job on the embedded default
#   make test  - create .venv, install with the test extras, run the test suite
PYTHON ?= python3.11
VENV   ?= .venv
PY      = $(VENV)/bin/python

.PHONY: run test lint bench clean-store chromium

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed-%: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[$*]'
	touch $@

run: $(VENV)/.installed-dev
	$(VENV)/bin/clma run $(ARGS)

# make test: extras dev + dask + flower. flwr's own pins conflict with prefect/the project's
# (see requirements/flower-no-deps.txt), so Flower is added without its pins after the rest.
$(VENV)/.installed-test: pyproject.toml requirements/flower-no-deps.txt | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[dev,dask]'
	$(PY) -m pip install -q --no-deps -r requirements/flower-no-deps.txt
	touch $@

# The browser test (tests/flows/test_browser_ui.py) drives Debian's Chromium (no browser
# download): installed with apt when missing (needs root, as on CI).
chromium:
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium chromium-driver)

test: $(VENV)/.installed-test chromium
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .

clean-store:
	rm -rf mlflow/store runs
