#!/usr/bin/env bash
# A simulated fleet on one machine: N boards, a monitoring host and a load balancer,
# each in its own network namespace with its own sshd, hostname, /srv (a per-host
# directory), /run (tmpfs) and copy-on-write overlays of /etc /opt /usr/local /var/lib
# /var/log, so users, units, configs and installs stay per host. A controller namespace
# holds the bridge (10.78.0.1), runs ansible and serves the wheelhouse over HTTP.
# The root namespace gets no addresses or routes; nothing here reaches the internet.
#
#   scripts/lab/lab_up.sh [N]          (default 3 boards)
#   env: FLEET_LAB_DIR (default /tmp/fleet-lab, becomes a tmpfs of FLEET_LAB_TMPFS_SIZE=6g),
#        FLEET_WHEELHOUSE (default /var/cache/appliance-fleet/wheelhouse, see build_wheelhouse.sh)
#
# Writes ansible/inventories/lab/hosts.yml and $FLEET_LAB_DIR/lab.env; tear down
# with scripts/lab/lab_down.sh (also safe after a partial start).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
LAB_DIR=${FLEET_LAB_DIR:-/tmp/fleet-lab}
WHEELHOUSE=${FLEET_WHEELHOUSE:-/var/cache/appliance-fleet/wheelhouse}
N=${1:-3}
P=flab                      # namespace prefix: flab-ctl, flab-board1, flab-mon, flab-lb
NET=10.78.0                 # lab subnet, only inside the namespaces
CTL=$P-ctl

[ "$(id -u)" = 0 ] || { echo "lab_up: needs root (network and mount namespaces)" >&2; exit 1; }
[ "$N" -ge 1 ] && [ "$N" -le 9 ] || { echo "lab_up: 1..9 boards" >&2; exit 1; }
if ip netns list | grep -q "^$P-"; then
  echo "lab_up: a lab is already up (ip netns list | grep $P-); run scripts/lab/lab_down.sh" >&2; exit 1
fi
[ -d "$WHEELHOUSE" ] || { echo "lab_up: no wheelhouse at $WHEELHOUSE (scripts/lab/build_wheelhouse.sh)" >&2; exit 1; }
for tool in /usr/sbin/sshd ssh-keygen unshare; do
  command -v "$tool" >/dev/null || { echo "lab_up: missing $tool (scripts/ci/install_fleet_deps.sh)" >&2; exit 1; }
done

# The lab lives in RAM: fast builds on the boards' overlays, and lab_down.sh frees it at once.
mkdir -p "$LAB_DIR"
if ! mountpoint -q "$LAB_DIR"; then
  mount -t tmpfs -o "size=${FLEET_LAB_TMPFS_SIZE:-6g},mode=755" fleet-lab "$LAB_DIR"
fi
mkdir -p "$LAB_DIR/ssh" "$LAB_DIR/hosts" "$LAB_DIR/cp"
[ -f "$LAB_DIR/ssh/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C fleet-lab -f "$LAB_DIR/ssh/id_ed25519"
cp "$LAB_DIR/ssh/id_ed25519.pub" "$LAB_DIR/ssh/authorized_keys"
: > "$LAB_DIR/empty_bashrc"

# hosts: name address group
HOSTS=()
for i in $(seq 1 "$N"); do HOSTS+=("board$i $NET.$((10 + i)) boards"); done
HOSTS+=("mon $NET.2 monitoring" "lb $NET.3 loadbalancer")

ip netns add "$CTL"
ip -n "$CTL" link set lo up
ip -n "$CTL" link add br0 type bridge
ip -n "$CTL" addr add "$NET.1/24" dev br0
ip -n "$CTL" link set br0 up

start_host() {  # name address
  local name=$1 addr=$2 ns=$P-$1 hd=$LAB_DIR/hosts/$1
  mkdir -p "$hd/srv" "$hd/upper" "$hd/work"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip link add eth0 netns "$ns" type veth peer name "v-$name" netns "$CTL"
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route add default via "$NET.1"
  ip -n "$CTL" link set "v-$name" master br0 up
  [ -f "$hd/ssh_host_ed25519_key" ] || ssh-keygen -q -t ed25519 -N '' -f "$hd/ssh_host_ed25519_key"
  cat > "$hd/sshd_config" <<CFG
Port 22
ListenAddress $addr
HostKey $hd/ssh_host_ed25519_key
PidFile $hd/sshd.pid
AuthorizedKeysFile $LAB_DIR/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxSessions 50
MaxStartups 50
Subsystem sftp internal-sftp
LogLevel ERROR
CFG
  mkdir -p /run/sshd && /usr/sbin/sshd -t -f "$hd/sshd_config"
  # Runs inside the host's own UTS + mount namespace, then becomes its sshd.
  cat > "$hd/boot.sh" <<BOOT
set -e
hostname $name
for d in etc opt usr/local var/lib var/log; do
  mkdir -p "$hd/upper/\$d" "$hd/work/\$d"
  mount -t overlay overlay -o "lowerdir=/\$d,upperdir=$hd/upper/\$d,workdir=$hd/work/\$d" "/\$d"
done
echo $name > /etc/hostname
mount -t tmpfs -o mode=755 tmpfs /run
mkdir -p /run/sshd
mount --bind "$hd/srv" /srv
# a developer's ~/.bashrc (pyenv init) costs ~0.5 s per ssh session: boards have none
[ -f /root/.bashrc ] && mount --bind "$LAB_DIR/empty_bashrc" /root/.bashrc
exec /usr/sbin/sshd -D -f "$hd/sshd_config" -E "$hd/sshd.log"
BOOT
  nohup setsid ip netns exec "$ns" unshare --uts --mount --propagation private sh "$hd/boot.sh" \
    > "$hd/boot.log" 2>&1 &
  echo $! > "$hd/launcher.pid"
}

for h in "${HOSTS[@]}"; do
  read -r name addr group <<< "$h"
  start_host "$name" "$addr"
  if [ "$group" = boards ]; then
    python3 "$REPO/scripts/lab/fake_sysfs.py" create "$LAB_DIR/hosts/$name/srv/fake-sysfs"
  fi
done

# The controller serves the wheelhouse to the boards (they have no other package source).
nohup setsid ip netns exec "$CTL" python3 -m http.server 8080 --bind "$NET.1" --directory "$WHEELHOUSE" \
  > "$LAB_DIR/wheelhouse_http.log" 2>&1 &
echo $! > "$LAB_DIR/wheelhouse_http.pid"

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
  echo "FLEET_LAB_INVENTORY=$INV"
} > "$LAB_DIR/lab.env"

# Wait for every sshd and for the wheelhouse server.
for h in "${HOSTS[@]}"; do
  read -r name addr g <<< "$h"
  for _ in $(seq 1 100); do
    ip netns exec "$CTL" bash -c "exec 3<>/dev/tcp/$addr/22" 2>/dev/null && break
    sleep 0.1
  done
  ip netns exec "$CTL" bash -c "exec 3<>/dev/tcp/$addr/22" 2>/dev/null \
    || { echo "lab_up: sshd on $name did not come up:"; cat "$LAB_DIR/hosts/$name/boot.log" "$LAB_DIR/hosts/$name/sshd.log" 2>/dev/null; exit 1; } >&2
done
for _ in $(seq 1 50); do
  ip netns exec "$CTL" bash -c "exec 3<>/dev/tcp/$NET.1/8080" 2>/dev/null && break
  sleep 0.1
done
echo "lab up: $N boards + mon + lb in $LAB_DIR; inventory $INV"
echo "run:    ip netns exec $CTL ansible-playbook -i $INV ansible/site.yml"
