#!/usr/bin/env bash
# Installs what the fleet tests need on a fresh Debian 12 machine (idempotent: a second
# run installs nothing): Debian packages for the simulated boards and the monitoring
# stack, ansible-core + ansible-lint in the venv, and the boards' wheelhouse.
#   scripts/ci/install_fleet_deps.sh          (root; VENV=.venv by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv}"

# sshd: the boards; nginx: the load balancer; prometheus (+promtool), node_exporter;
# systemd: systemd-analyze verify (not as init); build tools and python3-venv/-dev:
# the boards build the kernels; python3-apt: Ansible's apt module; ccache: board builds;
# vagrant: `vagrant validate`; iproute2 + util-linux: namespaces.
PACKAGES=(openssh-server openssh-client nginx prometheus prometheus-node-exporter systemd
          build-essential python3-dev python3-venv python3-apt python3-yaml ccache curl
          iproute2 util-linux vagrant ca-certificates)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "install_fleet_deps: need root to install ${missing[*]}" >&2; exit 1; }
  # Packages must not start their own services: the lab starts what it needs, where it needs it.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ] || ! grep -q "exit 101" "$policy"; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod 755 "$policy"
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
if ! "$VENV/bin/python" -c "import ansible, ansiblelint, yaml" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip --disable-pip-version-check -q install ansible-core ansible-lint pyyaml
fi

# The boards have no internet: their wheels come from this wheelhouse (stamped, so
# unchanged requirements download nothing).
scripts/lab/build_wheelhouse.sh "${FLEET_WHEELHOUSE:-/var/cache/appliance-fleet/wheelhouse}" \
  2>&1 | grep -v "^WARNING: Location" || true
echo "install_fleet_deps: ok (ansible-core $("$VENV/bin/python" -c 'import ansible.release as r; print(r.__version__)'))"
