# The two commands a newcomer needs:  make run   and   make test
# Everything is set up inside .venv from PyPI (torch comes from the machine's local wheel),
# Debian packages by the scripts in scripts/ci/ (idempotent; root, as on these machines).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
STAMP  := $(VENV)/.deps-stamp
HOST   ?= 127.0.0.1
PORT   ?= 8080

.PHONY: run test test-python test-fast build setup system-deps clean bench

$(STAMP): pyproject.toml requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel "cython>=3.0" numpy
	$(PIP) install -r requirements-test.txt
	touch $(STAMP)

setup: $(STAMP)

# Compiles the kernels for this machine (in place, editable install: the repo is the package).
build: $(STAMP)
	$(PIP) install --no-build-isolation --no-deps -e .

system-deps:
	bash scripts/ci/install_server_deps.sh

run: build
	@echo "dashboard: http://$(HOST):$(PORT)/"
	$(VENV)/bin/appliance serve --host $(HOST) --port $(PORT)

# Every test: the Python suites (kernels, models, engine, server with browser and Prometheus),
# then the aarch64 suite under qemu (mk/arm.mk) and the fleet: static checks and the simulated
# boards (mk/fleet.mk). Each part stops the run on failure.
test: build system-deps
	$(PY) -m pytest -q tests --ignore=tests/fleet
	$(MAKE) test-arm
	$(MAKE) test-fleet

test-fast: build
	$(PY) -m pytest -q -m "not slow" tests --ignore=tests/fleet

bench: build
	$(PY) bench/compare_llamacpp.py

clean:
	rm -rf build appliance/kernels/_*.so kernels/kernels.c kernels/kvops.c *.egg-info

include mk/arm.mk
include mk/fleet.mk
