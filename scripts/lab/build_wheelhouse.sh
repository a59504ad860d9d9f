#!/usr/bin/env bash
# Builds the wheelhouse the boards install from (they have no internet): the build
# requirements (pyproject [build-system]) and the runtime dependencies of the appliance,
# as wheels for the boards' platform. The controller then serves it (the lab: a small
# HTTP server in the controller namespace; a fleet: appliance_wheelhouse_url, or the
# appliance role copies the directory to each board).
#
#   scripts/lab/build_wheelhouse.sh [DIR] [--arch aarch64|x86_64] [--python 3.11] [--check]
#       DIR defaults to $FLEET_WHEELHOUSE or /var/cache/appliance-fleet/wheelhouse
#       --arch aarch64   wheels for RK3588 boards (manylinux aarch64), from any controller
#
# Idempotent: a stamp of the requirement list skips a second download. --check only
# tells (exit 1) whether DIR is missing or stale, without downloading anything.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${FLEET_WHEELHOUSE:-/var/cache/appliance-fleet/wheelhouse}
ARCH=""
PYVER=""
CHECK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH=$2; shift 2 ;;
    --python) PYVER=$2; shift 2 ;;
    --check) CHECK=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) DIR=$1; shift ;;
  esac
done
PY=${PYTHON:-python3}
[ -x "$REPO/.venv/bin/python" ] && PY=$REPO/.venv/bin/python

# requirement list: build-system requires + project dependencies (pyproject is the source)
REQS=$("$PY" - "$REPO/pyproject.toml" <<'PYEOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    data = tomllib.load(f)
reqs = list(data.get("build-system", {}).get("requires", []))
reqs += data.get("project", {}).get("dependencies", [])
print("\n".join(dict.fromkeys(reqs)))
PYEOF
)
STAMP_TEXT=$(printf '%s\n' "$REQS" "arch=$ARCH" "python=$PYVER")

# the requirements without a wheel in DIR (wheel names: lower case, '-' and '.' as '_')
missing_wheels() {
  local req name
  while read -r req; do
    [ -n "$req" ] || continue
    name=$(printf '%s' "$req" | sed -E 's/[ ;<>=!~\[].*//' | tr 'A-Z.-' 'a-z__')
    compgen -G "$DIR/${name}-*.whl" >/dev/null || echo "$name"
  done <<< "$REQS"
}
if [ -f "$DIR/.stamp" ] && [ "$(cat "$DIR/.stamp")" = "$STAMP_TEXT" ]; then
  MISSING=$(missing_wheels | tr '\n' ' ')
  if [ -z "$MISSING" ]; then
    echo "wheelhouse up to date: $DIR ($(ls "$DIR"/*.whl | wc -l) wheels)"
    exit 0
  fi
  echo "wheelhouse lacks wheels for: $MISSING" >&2
fi
if [ "$CHECK" = 1 ]; then
  echo "wheelhouse missing or stale: $DIR (scripts/ci/install_fleet_deps.sh or $0 $DIR)" >&2
  exit 1
fi

mkdir -p "$DIR"
args=(--disable-pip-version-check -q download --dest "$DIR")
if [ -n "$ARCH" ]; then
  # wheels for another platform: binary only, for the boards' Python and glibc (Debian 12: 3.11,
  # 2.36). pip matches these tags exactly: llguidance's aarch64 wheel is manylinux_2_31.
  args+=(--only-binary=:all: --implementation cp --python-version "${PYVER:-3.11}"
         --platform "manylinux_2_31_$ARCH" --platform "manylinux_2_28_$ARCH"
         --platform "manylinux2014_$ARCH" --platform "manylinux_2_17_$ARCH")
elif [ -n "$PYVER" ]; then
  args+=(--only-binary=:all: --python-version "$PYVER")
fi
mapfile -t req_array <<< "$REQS"
"$PY" -m pip "${args[@]}" "${req_array[@]}" pip
printf '%s\n' "$STAMP_TEXT" > "$DIR/.stamp"
echo "wheelhouse: $DIR ($(ls "$DIR"/*.whl | wc -l) wheels)"
