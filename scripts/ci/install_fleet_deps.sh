#!/usr/bin/env bash
# Installs what the fleet tests need on a fresh Debian 12 machine (idempotent: a second
# run installs and downloads nothing): Debian packages for the lab and the static checks,
# ansible-core + ansible-lint in the venv, the boards' wheelhouse and the Debian root the
# simulated hosts boot (both cached outside the repository).
#   scripts/ci/install_fleet_deps.sh          (root; VENV=.venv by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv}"
CACHE=/var/cache/appliance-fleet

# systemd-container: systemd-nspawn boots every lab host's own systemd; debootstrap: the
# Debian root they boot; openssh-client: the controller; prometheus (promtool),
# prometheus-alertmanager (amtool), node_exporter (the fake sysfs test), systemd
# (systemd-analyze verify), vagrant (`vagrant validate`); iproute2 + util-linux:
# namespaces, nsenter; apt-utils (apt-ftparchive) + gnupg: the fleet's APT repository;
# openssl: the fleet CA and certificates; nftables: nft checks the firewall's rules;
# nginx + libnginx-mod-http-js: the load balancer's
# configuration and its njs router run against stand-in boards.
PACKAGES=(systemd-container debootstrap openssh-client prometheus prometheus-alertmanager
          prometheus-node-exporter systemd python3-yaml curl iproute2 util-linux vagrant
          ca-certificates apt-utils gnupg openssl nftables nginx libnginx-mod-http-js)
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
# passlib + bcrypt: password_hash (the basic-auth credentials of /boards/ and node_exporter;
# bcrypt 4.1+ breaks passlib 1.7.4's backend detection).
if ! "$VENV/bin/python" -c "import ansible, ansiblelint, yaml, jinja2, passlib, bcrypt" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip --disable-pip-version-check -q install ansible-core ansible-lint pyyaml jinja2 passlib \
    "bcrypt>=4,<4.1"
fi

# The boards have no internet: their wheels come from this wheelhouse (stamped, so
# unchanged requirements download nothing).
scripts/lab/build_wheelhouse.sh "${FLEET_WHEELHOUSE:-$CACHE/wheelhouse}" \
  2>&1 | grep -v "^WARNING: Location" || true
# The root file system every lab host boots (systemd, sshd, the boards' build tools and the
# monitoring packages), stamped likewise.
scripts/lab/build_rootfs.sh "${FLEET_ROOTFS:-$CACHE/rootfs}"
# Nor do they reach Debian's archive: the fleet's own APT repository, built from the pinned
# list in ansible/files/apt-packages.txt, is what the controller serves them. A pin that a
# Debian security update superseded takes that update here (with a warning to bump the list):
# bookworm-security keeps only its newest version, and the lab must not break on its release.
scripts/lab/build_apt_repo.sh "${FLEET_APT_REPO:-$CACHE/apt-repo}" --accept-updates
echo "install_fleet_deps: ok (ansible-core $("$VENV/bin/python" -c 'import ansible.release as r; print(r.__version__)'))"
