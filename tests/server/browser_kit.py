"""Debian's Chromium through pip's Playwright (never `playwright install`), for the dashboard tests.

Imported by name (`from browser_kit import ...`), like live_server.
"""
from __future__ import annotations

import os

CHROMIUM = os.environ.get("APPLIANCE_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# Pixels drawn on each canvas (by id): axes, lines and legend ink a chart, an empty one says so in a few.
INKED = """(ids) => ids.map(id => { const c = document.getElementById(id);
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;
    for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; })"""
