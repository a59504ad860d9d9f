# make test-fleet: the Ansible roles and playbooks, the Prometheus rules and the Grafana
# dashboard, statically (lint, syntax, promtool, Vagrant) and on a simulated fleet: 3 boards,
# a monitoring host and a load balancer in network namespaces with their own sshd, driven
# by ansible-playbook over ssh, with a live Prometheus. See scripts/ci/test_fleet.sh.
#
# Included from the Makefile after PY and STAMP are defined:   include mk/fleet.mk
# Needs root (apt-get, namespaces, mounts). The boards' wheelhouse is cached in
# FLEET_WHEELHOUSE, outside the repository.
FLEET_WHEELHOUSE ?= /var/cache/appliance-fleet/wheelhouse

.PHONY: test-fleet fleet-deps
fleet-deps: $(STAMP)
	VENV="$(VENV)" FLEET_WHEELHOUSE="$(FLEET_WHEELHOUSE)" bash scripts/ci/install_fleet_deps.sh

test-fleet: fleet-deps
	VENV="$(VENV)" FLEET_WHEELHOUSE="$(FLEET_WHEELHOUSE)" bash scripts/ci/test_fleet.sh
