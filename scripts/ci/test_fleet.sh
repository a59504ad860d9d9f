#!/usr/bin/env bash
# The whole fleet suite: static checks (lint, syntax, promtool, dashboard, Vagrant) and
# the network-namespace lab (3 boards + monitoring + load balancer over real ssh, a live
# Prometheus). Exits non-zero on any failure; always tears the lab down.
#   scripts/ci/install_fleet_deps.sh && scripts/ci/test_fleet.sh [pytest args]
# Traffic stays on 127.0.0.1 and inside the lab's own namespaces (10.78.0.0/24 exists
# only there); nothing is fetched (the wheelhouse is built by install_fleet_deps.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv}"
export FLEET_REQUIRE_TOOLS=1
export FLEET_LAB_DIR="${FLEET_LAB_DIR:-/tmp/fleet-lab}"
export FLEET_WHEELHOUSE="${FLEET_WHEELHOUSE:-/var/cache/appliance-fleet/wheelhouse}"

cleanup() { scripts/lab/lab_down.sh >/dev/null 2>&1 || true; }
trap cleanup EXIT INT TERM
if ip netns list 2>/dev/null | grep -q '^flab-'; then
  echo "test_fleet: a fleet lab is up already; tearing it down first" >&2
  cleanup
fi
# The boards' wheels must be there already: the tests download nothing.
scripts/lab/build_wheelhouse.sh "$FLEET_WHEELHOUSE" --check

start=$(date +%s)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs --durations=12 tests/fleet "$@"
echo "test_fleet: $(( $(date +%s) - start )) s"
