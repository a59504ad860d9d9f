#!/usr/bin/env bash
# Tears down what lab_up.sh and the playbook runs started, and nothing else: ssh control
# masters of the lab, each host's container (an orderly poweroff of its systemd, then
# whatever is left in its namespace), the controller's servers, the hosts' overlays and
# memory cgroups, the namespaces and the lab dir. Safe to run twice and after a partial
# lab_up.sh.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
LAB_DIR=${FLEET_LAB_DIR:-/tmp/fleet-lab}
P=flab
CGROUP=/sys/fs/cgroup/memory/$P
CPUACCT=/sys/fs/cgroup/cpuacct/$P
CPUCG=/sys/fs/cgroup/cpu/$P

for s in "$LAB_DIR"/cp/*; do
  [ -S "$s" ] && ssh -O exit -o ControlPath="$s" lab-host >/dev/null 2>&1
done
namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^$P-"; }
# CPU each host used (its systemd, services, builds and ssh sessions), before they go.
if [ "${FLEET_LAB_CPU_REPORT:-1}" = 1 ] && [ -d "$CPUACCT" ]; then
  report=""
  for d in "$CPUACCT"/*/; do
    [ -f "$d/cpuacct.usage" ] || continue
    report+=" $(basename "$d")=$(( $(cat "$d/cpuacct.usage") / 1000000000 ))s"
  done
  [ -n "$report" ] && echo "lab CPU per host:$report"
fi
# SIGTERM to systemd-nspawn powers its container off in order (units stop, journald syncs).
nspawns=()
for f in "$LAB_DIR"/hosts/*/nspawn.pid; do
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null && nspawns+=("$pid")
done
for _ in $(seq 1 60); do
  alive=0
  for pid in "${nspawns[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ "$alive" = 0 ] && break
  sleep 0.5
done
for sig in TERM KILL; do
  for ns in $(namespaces); do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -s "$sig" $pids 2>/dev/null
  done
  for f in "$LAB_DIR"/hosts/*/nspawn.pid "$LAB_DIR"/wheelhouse_http.pid "$LAB_DIR"/apt_http.pid \
           "$LAB_DIR"/webhook_receiver.pid; do
    [ -f "$f" ] && kill -s "$sig" "$(cat "$f")" 2>/dev/null
  done
  [ "$sig" = TERM ] && sleep 1
done
for root in "$LAB_DIR"/hosts/*/root; do
  mountpoint -q "$root" && { umount "$root" 2>/dev/null || umount -l "$root"; }
done
for cg in "$CGROUP" "$CPUACCT" "$CPUCG"; do
  [ -d "$cg" ] && find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null
done
for ns in $(namespaces); do
  for _ in 1 2 3 4 5; do ip netns del "$ns" 2>/dev/null && break; sleep 0.2; done
done
rm -f "$REPO/ansible/inventories/lab/hosts.yml"
# The overlays are gone; the tmpfs holding everything goes now.
if mountpoint -q "$LAB_DIR"; then
  umount "$LAB_DIR" 2>/dev/null || umount -l "$LAB_DIR"
fi
[ -d "$LAB_DIR" ] && rm -rf "$LAB_DIR"
if namespaces | grep -q .; then echo "lab_down: namespaces left: $(namespaces | xargs)" >&2; exit 1; fi
for cg in "$CGROUP" "$CPUACCT" "$CPUCG"; do [ -d "$cg" ] && echo "lab_down: cgroups left under $cg" >&2; done
echo "lab down"
