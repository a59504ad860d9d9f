#!/usr/bin/env bash
# A simulated fleet on one machine: N boards, a monitoring host and a load balancer, each
# a systemd-nspawn container that boots Debian's own systemd (PID 1, journald, dbus, sshd)
# inside its own network namespace, from a copy-on-write layer over one Debian root
# (scripts/lab/build_rootfs.sh). The roles therefore run against real systemd units:
# hardening, cgroup memory limits, journald, restarts - what the boards run.
# A controller namespace holds the bridge (10.78.0.1), runs ansible, serves the wheelhouse
# over HTTP and records Alertmanager's webhook notifications. The root namespace gets no
# addresses or routes; nothing here reaches the internet.
#
#   scripts/lab/lab_up.sh [N]          (default 3 boards)
#   env: FLEET_LAB_DIR (default /tmp/fleet-lab, becomes a tmpfs of FLEET_LAB_TMPFS_SIZE=6g),
#        FLEET_WHEELHOUSE (default /var/cache/appliance-fleet/wheelhouse, build_wheelhouse.sh),
#        FLEET_ROOTFS (default /var/cache/appliance-fleet/rootfs, build_rootfs.sh),
#        FLEET_APT_REPO (default /var/cache/appliance-fleet/apt-repo, build_apt_repo.sh)
#
# Writes ansible/inventories/lab/hosts.yml and $FLEET_LAB_DIR/lab.env; enter a host with
# scripts/lab/lab_exec.sh HOST CMD; tear down with scripts/lab/lab_down.sh (also safe
# after a partial start).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
LAB_DIR=${FLEET_LAB_DIR:-/tmp/fleet-lab}
WHEELHOUSE=${FLEET_WHEELHOUSE:-/var/cache/appliance-fleet/wheelhouse}
ROOTFS_LINK=${FLEET_ROOTFS:-/var/cache/appliance-fleet/rootfs}
APT_REPO=${FLEET_APT_REPO:-/var/cache/appliance-fleet/apt-repo}
APT_PORT=8082
N=${1:-3}
P=flab                      # namespace prefix: flab-ctl, flab-board1, flab-mon, flab-lb
NET=10.78.0                 # lab subnet, only inside the namespaces
CTL=$P-ctl
WEBHOOK_PORT=9095
# The host has cgroup v1: nspawn mounts its memory controller read-only in the container.
# Each host gets a memory cgroup of its own, delegated writable (what a host systemd's
# Delegate= would do), so that the container's systemd enforces MemoryMax= itself.
CGROUP=/sys/fs/cgroup/memory/$P
# Each host's CPU is accounted in a cpuacct cgroup of its own (lab_down.sh reports it).
CPUACCT=/sys/fs/cgroup/cpuacct/$P
# ... and weighed in a cpu cgroup of its own; both delegated like the memory one, so that the
# container's systemd applies CPUWeight= (the service's, a release build's scope) in the kernel.
CPUCG=/sys/fs/cgroup/cpu/$P

[ "$(id -u)" = 0 ] || { echo "lab_up: needs root (namespaces, mounts, cgroups)" >&2; exit 1; }
[ "$N" -ge 1 ] && [ "$N" -le 9 ] || { echo "lab_up: 1..9 boards" >&2; exit 1; }
if ip netns list | grep -q "^$P-"; then
  echo "lab_up: a lab is already up (ip netns list | grep $P-); run scripts/lab/lab_down.sh" >&2; exit 1
fi
[ -d "$WHEELHOUSE" ] || { echo "lab_up: no wheelhouse at $WHEELHOUSE (scripts/lab/build_wheelhouse.sh)" >&2; exit 1; }
[ -f "$APT_REPO/repo/InRelease" ] || { echo "lab_up: no APT repository at $APT_REPO (scripts/lab/build_apt_repo.sh)" >&2; exit 1; }
"$REPO/scripts/lab/build_rootfs.sh" "$ROOTFS_LINK" --check >/dev/null
ROOTFS=$(readlink -f "$ROOTFS_LINK")
for tool in systemd-nspawn nsenter ssh-keygen unshare; do
  command -v "$tool" >/dev/null || { echo "lab_up: missing $tool (scripts/ci/install_fleet_deps.sh)" >&2; exit 1; }
done
for c in memory cpuacct cpu; do
  [ -d "/sys/fs/cgroup/$c" ] || { echo "lab_up: no cgroup v1 $c controller at /sys/fs/cgroup/$c" >&2; exit 1; }
done

# The lab lives in RAM: fast builds in the hosts' layers, and lab_down.sh frees it at once.
mkdir -p "$LAB_DIR"
if ! mountpoint -q "$LAB_DIR"; then
  mount -t tmpfs -o "size=${FLEET_LAB_TMPFS_SIZE:-6g},mode=755" fleet-lab "$LAB_DIR"
fi
mkdir -p "$LAB_DIR/ssh" "$LAB_DIR/hosts" "$LAB_DIR/cp" "$LAB_DIR/webhook"
[ -f "$LAB_DIR/ssh/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C fleet-lab -f "$LAB_DIR/ssh/id_ed25519"

# hosts: name address group
HOSTS=()
for i in $(seq 1 "$N"); do HOSTS+=("board$i $NET.$((10 + i)) boards"); done
HOSTS+=("mon $NET.2 monitoring" "lb $NET.3 loadbalancer")

ip netns add "$CTL"
mkdir -p "$CPUACCT/ctl"            # scripts/lab/lab_ctl.sh accounts the controller's commands here
ip -n "$CTL" link set lo up
ip -n "$CTL" link add br0 type bridge
ip -n "$CTL" addr add "$NET.1/24" dev br0
ip -n "$CTL" link set br0 up

start_host() {  # name address
  local name=$1 addr=$2 ns=$P-$1 hd=$LAB_DIR/hosts/$1
  mkdir -p "$hd/srv" "$hd/upper" "$hd/work" "$hd/root"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip link add eth0 netns "$ns" type veth peer name "v-$name" netns "$CTL"
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route add default via "$NET.1"
  ip -n "$CTL" link set "v-$name" master br0 up
  # The host's own layer over the shared root: what it writes lands in $hd/upper.
  mount -t overlay overlay -o "lowerdir=$ROOTFS,upperdir=$hd/upper,workdir=$hd/work" "$hd/root"
  echo "$name" > "$hd/root/etc/hostname"
  {
    echo "127.0.0.1 localhost"
    echo "127.0.1.1 $name"
    for h in "${HOSTS[@]}"; do read -r n a _ <<< "$h"; echo "$a $n"; done
  } > "$hd/root/etc/hosts"
  od -An -N16 -tx1 /dev/urandom | tr -d ' \n' > "$hd/root/etc/machine-id"
  ssh-keygen -q -A -f "$hd/root"
  install -d -m 700 "$hd/root/root/.ssh"
  install -m 600 "$LAB_DIR/ssh/id_ed25519.pub" "$hd/root/root/.ssh/authorized_keys"
  mkdir -p "$CGROUP/$name" "$CPUACCT/$name" "$CPUCG/$name"
  # --keep-unit --register=no: no systemd on this machine to register with; the container's
  # console goes to console.log. /srv is a directory of this machine (the fake sysfs).
  # /proc/sys/net is the host's own network namespace: writable, as on a machine; so is its
  # packet filter (CAP_NET_ADMIN there: the firewall role's nftables).
  nohup setsid sh -c 'for g in "$1" "$2" "$3"; do echo $$ > "$g/cgroup.procs" || exit 1; done; shift 3; exec "$@"' _ \
    "$CGROUP/$name" "$CPUACCT/$name" "$CPUCG/$name" \
    env SYSTEMD_NSPAWN_API_VFS_WRITABLE=network \
    systemd-nspawn --quiet --boot --register=no --keep-unit --machine="$name" --directory="$hd/root" \
    --network-namespace-path="/run/netns/$ns" --bind="$hd/srv:/srv" --link-journal=no \
    --capability=CAP_NET_ADMIN \
    > "$hd/console.log" 2>&1 &
  echo $! > "$hd/nspawn.pid"
}

wait_booted() {  # name
  local name=$1 hd=$LAB_DIR/hosts/$1 leader="" state=""
  for _ in $(seq 1 120); do
    leader=$(pgrep -P "$(cat "$hd/nspawn.pid")" | head -1 || true)
    if [ -n "$leader" ]; then
      state=$(nsenter -t "$leader" -m -u -i -n -p -C systemctl is-system-running 2>/dev/null || true)
      case "$state" in running|degraded) break ;; esac
    fi
    sleep 0.5
  done
  case "$state" in
    running) ;;
    degraded) echo "lab_up: $name booted degraded:" >&2
              nsenter -t "$leader" -m -u -i -n -p -C systemctl --failed --no-legend >&2; return 1 ;;
    *) echo "lab_up: $name did not boot (state '$state'); its console:" >&2; tail -n 30 "$hd/console.log" >&2
       return 1 ;;
  esac
  echo "$leader" > "$hd/leader.pid"
  # The delegated cgroups writable, then systemd re-reads which controllers it may use. Its cgroup v1
  # code takes cpu and cpuacct for one joined hierarchy: it makes cpu groups only when it may write both.
  nsenter -t "$leader" -m -u -i -n -p -C sh -c \
    'for c in memory cpu cpuacct; do mount -o remount,bind,rw /sys/fs/cgroup/$c || exit 1; done
     systemctl daemon-reexec'
}

for h in "${HOSTS[@]}"; do
  read -r name addr group <<< "$h"
  start_host "$name" "$addr"
  if [ "$group" = boards ]; then
    python3 "$REPO/scripts/lab/fake_sysfs.py" create "$LAB_DIR/hosts/$name/srv/fake-sysfs"
  fi
done
for h in "${HOSTS[@]}"; do
  read -r name _ _ <<< "$h"
  wait_booted "$name"
done

# The controller serves the wheelhouse to the boards (they have no other package source)
# and records what Alertmanager delivers.
nohup setsid ip netns exec "$CTL" python3 -m http.server 8080 --bind "$NET.1" --directory "$WHEELHOUSE" \
  > "$LAB_DIR/wheelhouse_http.log" 2>&1 &
echo $! > "$LAB_DIR/wheelhouse_http.pid"
# ... and the fleet's APT repository (the hosts' only package source; its public key goes
# where the inventory's apt_source_key_file says).
install -m 644 "$APT_REPO/repo/fleet-archive.asc" "$LAB_DIR/fleet-archive.asc"
nohup setsid ip netns exec "$CTL" python3 -m http.server "$APT_PORT" --bind "$NET.1" --directory "$APT_REPO/repo" \
  > "$LAB_DIR/apt_http.log" 2>&1 &
echo $! > "$LAB_DIR/apt_http.pid"
nohup setsid ip netns exec "$CTL" python3 "$REPO/scripts/lab/webhook_receiver.py" --bind "$NET.1" \
  --port "$WEBHOOK_PORT" --dir "$LAB_DIR/webhook" > "$LAB_DIR/webhook_receiver.log" 2>&1 &
echo $! > "$LAB_DIR/webhook_receiver.pid"

# The project's rules with short `for:` for the lab's Prometheus (see inventories/lab).
PY=python3; [ -x "$REPO/.venv/bin/python" ] && PY=$REPO/.venv/bin/python
"$PY" "$REPO/scripts/lab/fast_rules.py" "$REPO/monitoring/prometheus/rules" "$LAB_DIR/rules" --for 10s

# Inventory for this lab (the group_vars beside it are committed).
INV=$REPO/ansible/inventories/lab/hosts.yml
{
  echo "# Generated by scripts/lab/lab_up.sh for the lab in $LAB_DIR: do not edit."
  echo "all:"
  echo "  vars:"
  echo "    ansible_user: root"
  echo "    ansible_ssh_private_key_file: $LAB_DIR/ssh/id_ed25519"
  echo "    fleet_lab_dir: $LAB_DIR"
  echo "    fleet_lab_controller: $NET.1"
  echo "    fleet_lab_webhook: http://$NET.1:$WEBHOOK_PORT"
  echo "    ansible_control_path_dir: $LAB_DIR/cp"
  echo "  children:"
  for group in boards monitoring loadbalancer; do
    echo "    $group:"
    echo "      hosts:"
    for h in "${HOSTS[@]}"; do
      read -r name addr g <<< "$h"
      [ "$g" = "$group" ] && echo "        $name: {ansible_host: $addr}"
    done
  done
} > "$INV"

{
  echo "FLEET_LAB_DIR=$LAB_DIR"
  echo "FLEET_LAB_NS_PREFIX=$P"
  echo "FLEET_LAB_CONTROLLER_NS=$CTL"
  echo "FLEET_LAB_BOARDS=\"$(seq -s ' ' -f 'board%g' 1 "$N")\""
  echo "FLEET_LAB_LB=$NET.3"
  echo "FLEET_LAB_MON=$NET.2"
  echo "FLEET_LAB_WEBHOOK=http://$NET.1:$WEBHOOK_PORT"
  echo "FLEET_LAB_INVENTORY=$INV"
} > "$LAB_DIR/lab.env"

# Wait for every sshd and for the controller's two servers.
reachable() { ip netns exec "$CTL" bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }
for h in "${HOSTS[@]}"; do
  read -r name addr g <<< "$h"
  for _ in $(seq 1 100); do reachable "$addr" 22 && break; sleep 0.1; done
  reachable "$addr" 22 || { echo "lab_up: sshd on $name does not answer; its console:" >&2
                            tail -n 20 "$LAB_DIR/hosts/$name/console.log" >&2; exit 1; }
done
for port in 8080 "$APT_PORT" "$WEBHOOK_PORT"; do
  for _ in $(seq 1 50); do reachable "$NET.1" "$port" && break; sleep 0.1; done
done
echo "lab up: $N boards + mon + lb (systemd-nspawn, $ROOTFS) in $LAB_DIR; inventory $INV"
echo "run:    cd ansible && ../scripts/lab/lab_ctl.sh ../.venv/bin/ansible-playbook -i $INV site.yml -e @inventories/lab/rollout.yml"
