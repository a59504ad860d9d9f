#!/usr/bin/env bash
# The whole fleet suite: static checks (lint, syntax, promtool, amtool, Alertmanager's
# inhibition, dashboard, Vagrant) and the lab: 3 boards + monitoring + load balancer, each
# a systemd-nspawn container booting its own systemd in its own network namespace, driven
# over real ssh, with a live Prometheus and Alertmanager. Exits non-zero on any failure;
# always tears its lab down.
#   scripts/ci/install_fleet_deps.sh && scripts/ci/test_fleet.sh [pytest args]
# Traffic stays on 127.0.0.1 and inside the lab's own namespaces (10.78.0.0/24 exists
# only there); nothing is fetched (install_fleet_deps.sh builds the wheelhouse and the
# hosts' root file system).
# One lab per machine: concurrent runs queue on a lock instead of breaking each other.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv}"
export FLEET_REQUIRE_TOOLS=1
export FLEET_LAB_DIR="${FLEET_LAB_DIR:-/tmp/fleet-lab}"
export FLEET_WHEELHOUSE="${FLEET_WHEELHOUSE:-/var/cache/appliance-fleet/wheelhouse}"
export FLEET_ROOTFS="${FLEET_ROOTFS:-/var/cache/appliance-fleet/rootfs}"
export FLEET_APT_REPO="${FLEET_APT_REPO:-/var/cache/appliance-fleet/apt-repo}"

mkdir -p /run/lock
exec 9>/run/lock/appliance-fleet-lab.lock
if ! flock -n 9; then
  echo "test_fleet: another fleet run holds the lab; waiting for it (at most 20 min)" >&2
  flock -w 1200 9 || { echo "test_fleet: the lab stayed busy for 20 min" >&2; exit 1; }
fi
export FLEET_LAB_LOCK_HELD=1       # the lab test's fixture must not wait for our own lock

cleanup() { scripts/lab/lab_down.sh >/dev/null 2>&1 || true; }
trap cleanup EXIT INT TERM
if ip netns list 2>/dev/null | grep -q '^flab-'; then
  echo "test_fleet: tearing down a lab left by a run that died" >&2   # we hold the lock: nobody owns it
  cleanup
fi
# The boards' wheels and the hosts' root must be there already: the tests download nothing.
scripts/lab/build_wheelhouse.sh "$FLEET_WHEELHOUSE" --check
scripts/lab/build_rootfs.sh "$FLEET_ROOTFS" --check
scripts/lab/build_apt_repo.sh "$FLEET_APT_REPO" --check

start=$(date +%s)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs --durations=12 tests/fleet "$@"
echo "test_fleet: $(( $(date +%s) - start )) s"
