# Two commands for a fresh machine (see README.md):
#   make run   - create .venv, install the server side, run the main job on the embedded default
#   make test  - create .venv, install everything (all extras + test tools), run the test suite
#   make test-quick - ruff + the tests that need no server, browser or deployment (< 5 min)
# Both install with plain `pip install -e '.[EXTRAS]'`: every extra co-resolves (pyproject.toml).
#   make device-venv - the lean install of a Flower SuperNode (flwr, torch, the library; no
#                      Prefect, no MLflow) in .venv-device
PYTHON ?= python3.11
VENV   ?= .venv
PY      = $(VENV)/bin/python
DEVICE_VENV ?= .venv-device
# what `make test` installs: the README's "everything" command, pip install -e '.[all,dev]'
TEST_EXTRAS = all,dev
# the suite on both cores, a test file per worker at a time (module fixtures built once;
# every server a test starts binds a free loopback port). Override: PYTEST_ARGS='-p no:xdist'
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: run test test-quick lint bench clean-store chromium device-venv

$(VENV)/bin/python $(DEVICE_VENV)/bin/python: %/bin/python:
	$(PYTHON) -m venv $*
	$*/bin/python -m pip install -q --upgrade pip

# One stamp per set of extras; a change of pyproject.toml re-installs.
$(VENV)/.installed-%: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e '.[$*]'
	touch $@

run: $(VENV)/.installed-server
	$(VENV)/bin/clma run $(ARGS)

# The browser test (tests/flows/test_browser_ui.py) drives Debian's Chromium (no browser
# download): installed with apt when missing (needs root, as on CI).
chromium:
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium chromium-driver)

test: $(VENV)/.installed-$(TEST_EXTRAS) chromium
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

# Before every commit: ruff and every test that starts no server, browser or deployment
# and runs no end-to-end flow (under 5 minutes on 2 cores; README "Tests").
QUICK = not slow and not server and not browser
test-quick: $(VENV)/.installed-$(TEST_EXTRAS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q -n 2 -m "$(QUICK)"

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .

$(DEVICE_VENV)/.installed-device: pyproject.toml | $(DEVICE_VENV)/bin/python
	$(DEVICE_VENV)/bin/python -m pip install -q -e '.[device]'
	touch $@

device-venv: $(DEVICE_VENV)/.installed-device

clean-store:
	rm -rf mlflow/store runs
