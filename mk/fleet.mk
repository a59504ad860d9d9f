# make test-fleet: the Ansible roles and playbooks, the Prometheus and Alertmanager
# configuration and the Grafana dashboard, statically (lint, syntax, promtool, amtool,
# Vagrant) and on a simulated fleet: 3 boards, a monitoring host and a load balancer, each
# a systemd-nspawn container booting its own systemd in its own network namespace, driven
# by ansible-playbook over ssh, with a live Prometheus and Alertmanager.
# See scripts/ci/test_fleet.sh.
#
# Included from the Makefile after PY and STAMP are defined:   include mk/fleet.mk
# Needs root (apt-get, namespaces, mounts, cgroups). The boards' wheelhouse and the hosts'
# Debian root are cached in FLEET_WHEELHOUSE and FLEET_ROOTFS, outside the repository.
FLEET_WHEELHOUSE ?= /var/cache/appliance-fleet/wheelhouse
FLEET_ROOTFS ?= /var/cache/appliance-fleet/rootfs
FLEET_ENV = VENV="$(VENV)" FLEET_WHEELHOUSE="$(FLEET_WHEELHOUSE)" FLEET_ROOTFS="$(FLEET_ROOTFS)"

.PHONY: test-fleet fleet-deps
fleet-deps: $(STAMP)
	$(FLEET_ENV) bash scripts/ci/install_fleet_deps.sh

test-fleet: fleet-deps
	$(FLEET_ENV) bash scripts/ci/test_fleet.sh
