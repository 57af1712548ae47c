# Two commands: `make quickstart` and `make test`. Both create .venv if missing and install the package
# with the tested pins in constraints.txt; re-running is fast (a stamp file keyed on the pins).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.cfg constraints.txt 2>/dev/null | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: install test quickstart clean-venv

$(STAMP): setup.cfg constraints.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,interop,rl]'
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

test: install
	$(PY) -m pytest -q -n 2 --dist loadgroup $(PYTEST_ARGS)

quickstart: install
	$(PY) -m experiments.quickstart

clean-venv:
	rm -rf $(VENV)
