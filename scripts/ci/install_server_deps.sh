#!/usr/bin/env bash
# Installs what the server tests need beyond requirements-test.txt: Debian's
# chromium (driven by pip's playwright, never `playwright install`) and prometheus
# (promtool + a live scrape). Idempotent: a second run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv}"

need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || need+=(prometheus)

if [ "${#need[@]}" -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "install_server_deps: need root to apt-get install ${need[*]}" >&2
        exit 1
    fi
    # Packages must not start their own services (no init here; tests run their own prometheus).
    policy=/usr/sbin/policy-rc.d
    if [ ! -e "$policy" ] || ! grep -q "exit 101" "$policy"; then
        printf '#!/bin/sh\nexit 101\n' > "$policy"
        chmod 755 "$policy"
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" fonts-dejavu-core >/dev/null
fi

if ! "$VENV/bin/python" -c "import playwright" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip --disable-pip-version-check -q install playwright
fi
if ! "$VENV/bin/python" -c "import yaml" >/dev/null 2>&1; then
    "$VENV/bin/python" -m pip --disable-pip-version-check -q install pyyaml
fi
echo "install_server_deps: chromium=$(command -v chromium) prometheus=$(command -v prometheus) playwright ok"
