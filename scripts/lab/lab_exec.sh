#!/usr/bin/env bash
# Runs a command inside one host of the lab (its mount, UTS, IPC, network, PID and cgroup
# namespaces, as root), the way `machinectl shell` would on a machine whose own systemd
# registered the container:
#   scripts/lab/lab_exec.sh board1 systemctl status appliance
#   scripts/lab/lab_exec.sh board2 journalctl -u appliance -n 20
set -euo pipefail
LAB_DIR=${FLEET_LAB_DIR:-/tmp/fleet-lab}
[ $# -ge 2 ] || { echo "usage: $0 HOST COMMAND [ARG...]" >&2; exit 2; }
host=$1; shift
leader_file=$LAB_DIR/hosts/$host/leader.pid
[ -f "$leader_file" ] || { echo "lab_exec: no host $host in $LAB_DIR (scripts/lab/lab_up.sh)" >&2; exit 2; }
exec nsenter -t "$(cat "$leader_file")" -m -u -i -n -p -C -- "$@"
