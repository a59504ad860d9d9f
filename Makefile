# The two commands a newcomer needs:  make run   and   make test
# Everything is set up inside .venv from PyPI (torch comes from the machine's local wheel),
# Debian packages by the scripts in scripts/ci/ (idempotent; root, as on these machines).
#   make run    the runtime only (pyproject.toml's dependencies), the kernels built once and
#               rebuilt only when their sources change, then the server with the demo model
#   make test   adds the test stack (requirements-test.txt) and the Debian packages tests drive
SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# Installs print one line; pip's and setuptools' chatter goes to a log, shown only on failure.
LOG    := $(VENV)/install.log
QUIET  := >>$(LOG) 2>&1 || { cat $(LOG); exit 1; }
HOST   ?= 127.0.0.1
PORT   ?= 8080

RUN_STAMP      := $(VENV)/.run-stamp        # build tools
EDITABLE_STAMP := $(VENV)/.editable-stamp   # the package, editable, with its runtime dependencies
BUILD_STAMP    := $(VENV)/.build-stamp      # the compiled kernels, up to date with their sources
STAMP          := $(VENV)/.deps-stamp       # the test stack (mk/*.mk depend on it)
KERNEL_SOURCES := setup.py $(wildcard kernels/*.c kernels/*.h kernels/*.pyx kernels/*.pxd kernels/*.pxi \
                                      kernels/*/*.c kernels/*/*.h)

.PHONY: run test test-python test-fast build setup system-deps clean bench

$(PY):
	@$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): | $(PY)
	@echo "setting up $(VENV): build tools"
	@$(PIP) install --upgrade pip setuptools wheel "cython>=3.0" numpy $(QUIET)
	@touch $@

$(EDITABLE_STAMP): pyproject.toml $(RUN_STAMP)
	@echo "installing the appliance and its runtime dependencies, building the kernels (log: $(LOG))"
	@$(PIP) install --no-build-isolation -e . $(QUIET)
	@touch $@

# Only when a kernel source or setup.py changed since the last build; then --force, because
# setuptools looks at the .c/.pyx files alone and would miss a changed header. The editable
# install compiles the kernels too: when no source is newer than it, they are built already.
$(BUILD_STAMP): $(KERNEL_SOURCES) $(EDITABLE_STAMP)
	@if [ -n "$$(find $(KERNEL_SOURCES) -newer $(EDITABLE_STAMP))" ]; then \
	  echo "building the kernels (their sources changed)"; \
	  $(PY) setup.py -q build_ext --inplace --force $(QUIET); \
	fi
	@touch $@

build: $(BUILD_STAMP)

$(STAMP): requirements-test.txt $(EDITABLE_STAMP)
	@echo "installing the test stack (requirements-test.txt)"
	@$(PIP) install -r requirements-test.txt $(QUIET)
	@touch $@

setup: $(STAMP)

system-deps:
	bash scripts/ci/install_server_deps.sh

# Prompt lookup on: on the demo model it wins on every task of bench/spec_bench.py
# (docs/performance.md); for other checkpoints it stays the operator's choice.
SPEC_LOOKUP ?= 4
run: build
	@$(VENV)/bin/appliance serve --host $(HOST) --port $(PORT) --spec-prompt-lookup $(SPEC_LOOKUP)

# Every test: the Python suites (kernels, models, engine, server with browser and Prometheus),
# then the aarch64 suite under qemu (mk/arm.mk) and the fleet: static checks and the simulated
# boards (mk/fleet.mk). Each part stops the run on failure.
test: build $(STAMP) system-deps
	$(PY) -m pytest -q tests --ignore=tests/fleet
	$(MAKE) test-arm
	$(MAKE) test-fleet

test-fast: build $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests --ignore=tests/fleet

bench: build $(STAMP)
	$(PY) bench/compare_llamacpp.py

clean:
	rm -rf build appliance/kernels/_*.so kernels/kernels.c *.egg-info $(VENV)/.*-stamp

include mk/arm.mk
include mk/fleet.mk
