#!/usr/bin/env bash
# Builds the Debian 12 root file system every simulated host of the lab boots with
# systemd-nspawn (scripts/lab/lab_up.sh): systemd, dbus, sshd and Python for Ansible,
# the boards' build tools, and the packages the roles install on the monitoring host and
# the load balancer (the lab has no internet, like a board whose image carries them).
# Package services stay disabled: the roles enable what each host runs.
#
#   scripts/lab/build_rootfs.sh [LINK] [--check]
#       LINK defaults to $FLEET_ROOTFS or /var/cache/appliance-fleet/rootfs; it points at
#       LINK-<hash of this script>, so a changed package list builds a new tree next to the
#       old one (a lab still running on the old one keeps its lower layer).
#   --check   only tell (exit 1) whether LINK is missing or stale; downloads nothing.
#
# Needs root, debootstrap and systemd-container; about 3 minutes from deb.debian.org.
set -euo pipefail
LINK=${FLEET_ROOTFS:-/var/cache/appliance-fleet/rootfs}
CHECK=0
for arg in "$@"; do
  case "$arg" in
    --check) CHECK=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) LINK=$arg ;;
  esac
done
SUITE=bookworm
MIRROR=http://deb.debian.org/debian
BOOT=systemd,systemd-sysv,dbus
# python3-apt: Ansible's apt module; build-essential ... ccache: the boards build the
# kernels; the rest: the monitoring host and the load balancer (libnginx-mod-http-js: njs,
# routing by model for boards with several).
PACKAGES=(openssh-server python3 python3-apt python3-venv python3-dev build-essential ccache
          ca-certificates curl iproute2 procps nginx libnginx-mod-http-js prometheus
          prometheus-node-exporter prometheus-alertmanager)
SERVICES_OFF=(nginx prometheus prometheus-node-exporter prometheus-alertmanager)
# Timers and first-boot prompts that only cost a simulated host time (or block its console).
MASKED=(apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer e2scrub_reap.service fstrim.timer
        man-db.timer dpkg-db-backup.timer systemd-firstboot.service console-getty.service)

HASH=$(sha256sum "$0" | cut -c1-12)
TREE=$LINK-$HASH
if [ -L "$LINK" ] && [ "$(readlink "$LINK")" = "$TREE" ] && [ -f "$TREE/.fleet-rootfs" ]; then
  echo "rootfs up to date: $TREE"
  exit 0
fi
if [ "$CHECK" = 1 ]; then
  echo "rootfs missing or stale: $LINK (scripts/ci/install_fleet_deps.sh or $0)" >&2
  exit 1
fi
[ "$(id -u)" = 0 ] || { echo "build_rootfs: needs root" >&2; exit 1; }
for tool in debootstrap systemd-nspawn; do
  command -v "$tool" >/dev/null || { echo "build_rootfs: missing $tool (scripts/ci/install_fleet_deps.sh)" >&2; exit 1; }
done

NEW=$TREE.new
rm -rf "$NEW"
mkdir -p "$(dirname "$LINK")"
start=$(date +%s)
debootstrap --variant=minbase --include="$BOOT" "$SUITE" "$NEW" "$MIRROR" >"$NEW.log" 2>&1 \
  || { tail -n 30 "$NEW.log" >&2; echo "build_rootfs: debootstrap failed (log $NEW.log)" >&2; exit 1; }
cat > "$NEW/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
SOURCES
printf '#!/bin/sh\nexit 101\n' > "$NEW/usr/sbin/policy-rc.d"   # no service starts while installing
chmod 755 "$NEW/usr/sbin/policy-rc.d"
# Not booted: nspawn only gives apt a proper /proc, /dev and the host's resolver.
systemd-nspawn -q --register=no --keep-unit --pipe -D "$NEW" --resolv-conf=copy-host \
  env DEBIAN_FRONTEND=noninteractive sh -c \
  "apt-get update -qq && apt-get install -y -qq --no-install-recommends ${PACKAGES[*]} && apt-get clean" \
  >>"$NEW.log" 2>&1 \
  || { tail -n 30 "$NEW.log" >&2; echo "build_rootfs: apt-get in the new root failed (log $NEW.log)" >&2; exit 1; }
rm -f "$NEW/usr/sbin/policy-rc.d"
systemctl --root="$NEW" disable "${SERVICES_OFF[@]}" >/dev/null 2>&1
systemctl --root="$NEW" mask "${MASKED[@]}" >/dev/null 2>&1
# Each host gets its own name, host keys and machine id (lab_up.sh writes them into its layer).
rm -f "$NEW"/etc/ssh/ssh_host_* "$NEW/etc/hostname"
: > "$NEW/etc/machine-id"
cat > "$NEW/etc/ssh/sshd_config.d/fleet-lab.conf" <<'SSHD'
# Key-only root login for the lab's controller; Ansible opens many sessions at once.
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UseDNS no
MaxSessions 50
MaxStartups 50
SSHD
rm -f "$NEW/etc/resolv.conf"
printf 'hash %s\nsuite %s\npackages %s\nbuilt %s\n' "$HASH" "$SUITE" "${PACKAGES[*]}" "$(date -u +%FT%TZ)" \
  > "$NEW/.fleet-rootfs"
mv "$NEW.log" "$NEW/.fleet-rootfs.log"
rm -rf "$TREE"
mv "$NEW" "$TREE"
ln -sfn "$TREE" "$LINK"
# Older trees go unless a lab still has one as its lower layer.
for old in "$LINK"-*; do
  [ "$old" = "$TREE" ] || [ ! -d "$old" ] && continue
  grep -q "lowerdir=$old" /proc/self/mountinfo || rm -rf "$old"
done
echo "rootfs: $TREE ($(du -sh "$TREE" | cut -f1), $(( $(date +%s) - start )) s)"
