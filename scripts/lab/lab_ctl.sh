#!/usr/bin/env bash
# Runs a command in the lab's controller namespace (the only way into the lab network),
# with its CPU accounted to the controller (lab_down.sh reports it beside each host's):
#   cd ansible && scripts/lab/lab_ctl.sh ansible-playbook -i inventories/lab/hosts.yml site.yml
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 COMMAND [ARG...]" >&2; exit 2; }
ip netns list | grep -q '^flab-ctl' || { echo "lab_ctl: no lab is up (scripts/lab/lab_up.sh)" >&2; exit 2; }
cpuacct=/sys/fs/cgroup/cpuacct/flab/ctl
[ -d "$cpuacct" ] && echo $$ > "$cpuacct/cgroup.procs"
exec ip netns exec flab-ctl "$@"
