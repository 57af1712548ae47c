# Two commands: `make quickstart` and `make test`. Both create .venv if missing and install the package
# with the tested pins in constraints.txt; re-running is fast (a stamp file keyed on the pins).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat setup.cfg constraints.txt 2>/dev/null | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

# libtpu (the TPU compiler) for ahead-of-time compilation on CPU machines (specjax.aot,
# experiments.tpu_plan, tests/test_aot_tpu.py): the version jax's `tpu` extra pins, installed with
# --target OUTSIDE the venv's import path (as a package, every CPU `import jax` would try to start a
# TPU). specjax.aot finds it at $(VENV)/libtpu/libtpu/libtpu.so.
LIBTPU_DIR := $(VENV)/libtpu
LIBTPU_STAMP := $(LIBTPU_DIR)/.installed-$(shell cat constraints.txt 2>/dev/null | sha1sum | cut -c1-12)

.PHONY: install libtpu test quickstart clean-venv

$(STAMP): setup.cfg constraints.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,interop,rl]'
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

$(LIBTPU_STAMP): | $(STAMP)
	@rm -rf $(LIBTPU_DIR)
	$(PY) -m pip install -q --target $(LIBTPU_DIR) \
		"$$($(PY) -c "import importlib.metadata as m; print(next(r.split(';')[0].strip() for r in m.requires('jax') if r.startswith('libtpu')))")"
	@touch $@

libtpu: $(LIBTPU_STAMP)

test: install libtpu
	$(PY) -m pytest -q -n 2 --dist loadgroup $(PYTEST_ARGS)

quickstart: install
	$(PY) -m experiments.quickstart

clean-venv:
	rm -rf $(VENV)
