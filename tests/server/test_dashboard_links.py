"""The dashboard points at the machine-readable faces of the server: the OpenAPI document (so a
client author finds it), /health and /metrics; every link answers."""
from __future__ import annotations

import re

import requests


def test_the_dashboard_links_the_api_document_and_every_link_answers(idle_server):
    page = requests.get(idle_server.base + "/", timeout=30)
    assert page.status_code == 200
    links = re.findall(r'<nav class="links">(.*?)</nav>', page.text, flags=re.S)
    assert links, "no link bar in the dashboard's header"
    hrefs = re.findall(r'href="([^"]+)"', links[0])
    assert hrefs[0] == "/openapi.json" and {"/health", "/metrics"} <= set(hrefs)
    for href in hrefs:
        assert requests.get(idle_server.base + href, timeout=30).status_code == 200, href
    assert requests.get(idle_server.base + "/openapi.json", timeout=30).json()["openapi"].startswith("3.")
