#!/usr/bin/env bash
# Builds the controller's APT repository: every package of a pinned list (name=version a
# line, ansible/files/apt-packages.txt) with its dependencies, minus what every Debian system
# has (Priority: required), downloaded through this machine's own apt sources, indexed by
# apt-ftparchive and signed with the fleet's archive key. The hosts' apt then uses this
# repository only (the apt_source role): no host needs a route to a registry.
#
#   scripts/lab/build_apt_repo.sh DIR [--packages FILE] [--check] [--accept-updates]
#     DIR/repo/      what is served (python3 -m http.server --directory DIR/repo) or copied:
#                    the .debs, Packages(.gz), Release, InRelease, fleet-archive.asc,
#                    manifest.txt (every package and version in it)
#     DIR/gnupg/     the archive's signing key (stays on the controller, never served)
#   --check   only tell (exit 1) whether DIR is missing or was built from another list.
#   --accept-updates  a pin whose exact version the sources no longer carry, superseded by a
#             Debian update of the same upstream version (bookworm-security keeps only the
#             newest, e.g. nginx 1.22.1-9+deb12u11 -> +deb12u12), takes that update, with a
#             warning to bump the list. Without it such a pin is an error naming the update.
#   --resolve-only  print the versions the list resolves to (name=version a line) and stop.
#
# The packages are those of this machine's architecture and release: build it on a
# controller of the boards' Debian release and architecture (or in a chroot of it).
# Needs apt-utils (apt-ftparchive) and gnupg; downloads from the machine's apt sources.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
DIR=""
LIST=$REPO/ansible/files/apt-packages.txt
CHECK=0
ACCEPT_UPDATES=0
RESOLVE_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --packages) LIST=$2; shift ;;
    --check) CHECK=1 ;;
    --accept-updates) ACCEPT_UPDATES=1 ;;
    --resolve-only) RESOLVE_ONLY=1 ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) DIR=$1 ;;
  esac
  shift
done
[ -n "$DIR" ] || [ "$RESOLVE_ONLY" = 1 ] || { echo "usage: $0 DIR [--packages FILE] [--check] [--accept-updates]" >&2; exit 2; }
[ -f "$LIST" ] || { echo "build_apt_repo: no package list $LIST" >&2; exit 2; }
ARCH=$(dpkg --print-architecture)
PINS=()
while read -r line; do
  line=${line%%#*}; line=$(echo "$line" | xargs)
  [ -z "$line" ] && continue
  case "$line" in
    *=*) PINS+=("$line") ;;
    *) echo "build_apt_repo: $LIST: '$line' has no version (name=version)" >&2; exit 2 ;;
  esac
done < "$LIST"
# The version of a pin that the sources carry: the pin itself, or (with --accept-updates) the
# newest Debian revision of the same upstream version when the pin's exact one is gone.
resolve_pin() {
  local name=$1 version=$2 available upstream newest="" v
  available=$(apt-cache madison "$name" | awk -F'|' '{gsub(/ /,"",$2); print $2}')
  if printf '%s\n' "$available" | grep -qxF "$version"; then
    echo "$version"; return 0
  fi
  upstream=${version%-*}
  while read -r v; do
    [ -n "$v" ] && [ "${v%-*}" = "$upstream" ] && dpkg --compare-versions "$v" gt "$version" || continue
    if [ -z "$newest" ] || dpkg --compare-versions "$v" gt "$newest"; then newest=$v; fi
  done <<< "$available"
  if [ -z "$newest" ]; then
    echo "build_apt_repo: $name $version is not in this machine's apt sources (apt-cache madison $name)" >&2
    return 1
  fi
  if [ "$ACCEPT_UPDATES" = 1 ]; then
    echo "build_apt_repo: warning: $name $version is superseded by $newest in the apt sources; the repository carries $newest (bump $LIST)" >&2
    echo "$newest"; return 0
  fi
  echo "build_apt_repo: $name $version is superseded by $newest in this machine's apt sources: bump the pin in $LIST (or pass --accept-updates)" >&2
  return 1
}

if [ "$RESOLVE_ONLY" = 1 ]; then
  for pin in "${PINS[@]}"; do
    version=$(resolve_pin "${pin%%=*}" "${pin#*=}") || exit 1
    echo "${pin%%=*}=$version"
  done
  exit 0
fi
STAMP=$( { printf '%s\n' "${PINS[@]}" | sort; echo "$ARCH"; sha256sum "$0" | cut -c1-64; } | sha256sum | cut -c1-16)
if [ -f "$DIR/repo/InRelease" ] && [ "$(cat "$DIR/.stamp" 2>/dev/null)" = "$STAMP" ]; then
  echo "apt repository up to date: $DIR/repo ($(grep -c . "$DIR/repo/manifest.txt") packages)"
  exit 0
fi
if [ "$CHECK" = 1 ]; then
  echo "apt repository missing or stale: $DIR (scripts/ci/install_fleet_deps.sh or $0 $DIR)" >&2
  exit 1
fi
for tool in apt-ftparchive gpg apt-get; do
  command -v "$tool" >/dev/null || { echo "build_apt_repo: missing $tool (apt-get install apt-utils gnupg)" >&2; exit 1; }
done
start=$(date +%s)
NAMES=()
RESOLVED=()
for pin in "${PINS[@]}"; do
  name=${pin%%=*}
  version=$(resolve_pin "$name" "${pin#*=}") || exit 1
  NAMES+=("$name")
  RESOLVED+=("$name=$version")
done
# The dependency closure (real packages only; alternatives are all taken, which costs a few
# extra small packages and never leaves one out).
mapfile -t CLOSURE < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
    --no-replaces --no-enhances "${NAMES[@]}" | grep -v '^ ' | grep -v '^<' | sort -u)
# Priority: required is in every Debian system (debootstrap's minbase): leave it out.
mapfile -t WANTED < <(apt-cache show --no-all-versions "${CLOSURE[@]}" 2>/dev/null | awk '
    /^Package:/ {p=$2} /^Priority:/ {if ($2 != "required") print p}' | sort -u)
NEW=$DIR/repo.new
rm -rf "$NEW"
mkdir -p "$NEW" "$DIR/gnupg"
chmod 700 "$DIR/gnupg"
TARGETS=("${RESOLVED[@]}")
for name in "${WANTED[@]}"; do
  printf '%s\n' "${NAMES[@]}" | grep -qxF "$name" || TARGETS+=("$name")
done
(cd "$NEW" && apt-get download -qq -o APT::Sandbox::User=root "${TARGETS[@]}") \
  || { echo "build_apt_repo: apt-get download failed" >&2; exit 1; }
export GNUPGHOME=$DIR/gnupg
if ! gpg --batch --list-secret-keys fleet-archive >/dev/null 2>&1; then
  gpg --batch --quiet --passphrase '' --quick-gen-key "fleet-archive (appliance fleet APT repository)" \
    ed25519 sign never
fi
(
  cd "$NEW"
  apt-ftparchive packages . > Packages
  gzip -9nk Packages
  apt-ftparchive -o APT::FTPArchive::Release::Origin=appliance-fleet \
    -o APT::FTPArchive::Release::Label=appliance-fleet -o APT::FTPArchive::Release::Architectures="$ARCH" \
    release . > Release
  gpg --batch --yes --armor --local-user fleet-archive --clearsign -o InRelease Release
  gpg --batch --armor --export fleet-archive > fleet-archive.asc
  for deb in *.deb; do dpkg-deb -f "$deb" Package Version | paste -sd' '; done \
    | sed 's/^Package: \(.*\) Version: \(.*\)$/\1 \2/' > manifest.txt
)
rm -rf "$DIR/repo"
mv "$NEW" "$DIR/repo"
echo "$STAMP" > "$DIR/.stamp"
echo "apt repository: $DIR/repo ($(grep -c . "$DIR/repo/manifest.txt") packages, $(du -sh "$DIR/repo" | cut -f1), $(( $(date +%s) - start )) s)"
