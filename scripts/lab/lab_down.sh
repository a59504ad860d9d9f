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
# overlays unmount with their mount namespace; if one lingers, leave the dir for inspection
if [ "${FLEET_LAB_KEEP:-0}" != 1 ] && ! grep -q " $LAB_DIR/" /proc/*/mountinfo 2>/dev/null; then
  rm -rf "$LAB_DIR"
fi
if namespaces | grep -q .; then echo "lab_down: namespaces left: $(namespaces | xargs)" >&2; exit 1; fi
echo "lab down"
