# The two commands a newcomer needs:  make run   and   make test
# Everything is set up inside .venv from PyPI (torch comes from the machine's local wheel).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.deps-stamp

.PHONY: run test test-fast test-arm test-fleet build setup clean bench

$(STAMP): pyproject.toml requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel "cython>=3.0" numpy
	$(PIP) install -r requirements-test.txt
	touch $(STAMP)

setup: $(STAMP)

build: $(STAMP)
	$(PIP) install --no-build-isolation --no-deps -e .

run: build
	$(VENV)/bin/appliance serve-or-generate

test: build
	$(VENV)/bin/python -m pytest -q tests

test-fast: build
	$(VENV)/bin/python -m pytest -q -m "not slow" tests

bench: build
	$(VENV)/bin/python bench/compare_llamacpp.py

clean:
	rm -rf build appliance/_kernels*.so kernels/kernels.c *.egg-info
