#!/usr/bin/env bash
# Tears down what lab_up.sh and the playbook runs started, and nothing else: ssh
# control masters of the lab, every process inside the lab's namespaces (sshd,
# supervisors and their services, nginx, prometheus, the wheelhouse server), the
# namespaces themselves (their overlay and tmpfs mounts go with them) and the lab dir.
# Safe to run twice and after a partial lab_up.sh.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
LAB_DIR=${FLEET_LAB_DIR:-/tmp/fleet-lab}
P=flab

for s in "$LAB_DIR"/cp/*; do
  [ -S "$s" ] && ssh -O exit -o ControlPath="$s" lab-host >/dev/null 2>&1
done
namespaces() { ip netns list 2>/dev/null | awk '{print $1}' | grep "^$P-"; }
# CPU the lab used (services, ssh sessions and what they ran), before the processes go.
if [ "${FLEET_LAB_CPU_REPORT:-1}" = 1 ]; then
  ticks=0
  for ns in $(namespaces); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      t=$(awk '{print $14 + $15 + $16 + $17}' "/proc/$pid/stat" 2>/dev/null || echo 0)
      ticks=$((ticks + ${t:-0}))
    done
  done
  [ "$ticks" -gt 0 ] && echo "lab CPU inside the namespaces: $((ticks / $(getconf CLK_TCK))) s"
fi
for sig in TERM KILL; do
  for ns in $(namespaces); do
    pids=$(ip netns pids "$ns" 2>/dev/null)
    [ -n "$pids" ] && kill -s "$sig" $pids 2>/dev/null
  done
  for f in "$LAB_DIR"/hosts/*/launcher.pid "$LAB_DIR"/wheelhouse_http.pid; do
    [ -f "$f" ] && kill -s "$sig" "$(cat "$f")" 2>/dev/null
  done
  [ "$sig" = TERM ] && sleep 1
done
for ns in $(namespaces); do
  for _ in 1 2 3 4 5; do ip netns del "$ns" 2>/dev/null && break; sleep 0.2; done
done
rm -f "$REPO/ansible/inventories/lab/hosts.yml"
# The overlays went with the namespaces; the tmpfs holding everything goes now.
if mountpoint -q "$LAB_DIR"; then
  umount "$LAB_DIR" 2>/dev/null || umount -l "$LAB_DIR"
fi
[ -d "$LAB_DIR" ] && rm -rf "$LAB_DIR"
if namespaces | grep -q .; then echo "lab_down: namespaces left: $(namespaces | xargs)" >&2; exit 1; fi
echo "lab down"
