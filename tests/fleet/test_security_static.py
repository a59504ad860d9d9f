"""The lock-down pieces without a lab: the firewall's rules as nft parses them, the load
balancer's TLS and /boards/ access, the fleet CA script (certificates verified by openssl,
keys vault-encrypted), the pinned package list."""
from __future__ import annotations

import re
import subprocess

import pytest

from conftest import ANSIBLE_DIR, render_role_template, run, tool

INVENTORY = {"board1": {"ansible_host": "10.0.0.11"}, "board2": {"ansible_host": "10.0.0.12"},
             "lb": {"ansible_host": "10.0.0.3"}, "mon": {"ansible_host": "10.0.0.2", "fleet_address": "fd00::2"}}
GROUPS = {"boards": ["board1", "board2"], "loadbalancer": ["lb"], "monitoring": ["mon"]}
# The balancer's routes for boards of one model each (the role's routes filter computes them).
ROUTES = {"loadbalancer_fleet_routes": {"by_model": False, "upstreams": {}}}


def firewall(host: str, **extra) -> str:
    import yaml
    defaults = yaml.safe_load((ANSIBLE_DIR / "roles/firewall/defaults/main.yml").read_text())
    group_names = [g for g, hosts in GROUPS.items() if host in hosts]
    rules = [r for g, rs in defaults["firewall_group_rules"].items() if g in group_names for r in rs]
    return render_role_template("firewall", "nftables.conf.j2", groups=GROUPS, hostvars=INVENTORY,
                                inventory_hostname=host, group_names=group_names,
                                firewall_rules=extra.pop("firewall_rules", rules), **extra)


def test_board_rules_open_the_api_to_the_balancer_and_monitoring_and_node_exporter_to_monitoring():
    rules = firewall("board1")
    assert "policy drop;" in rules and "tcp dport 22 accept" in rules
    assert "ip saddr { 10.0.0.3 } tcp dport { 8080 } accept" in rules
    assert "ip6 saddr { fd00::2 } tcp dport { 8080 } accept" in rules      # monitoring by its fleet_address
    assert "ip6 saddr { fd00::2 } tcp dport { 9100 } accept" in rules
    assert "10.0.0.12" not in rules, "another board is allowed in"
    assert "reject with tcp reset" in rules
    balancer = firewall("lb")
    assert "tcp dport { 80, 443 } accept" in balancer and "saddr { 10.0.0.3 }" not in balancer
    narrow = firewall("board1", firewall_ssh_sources=["192.0.2.1"], firewall_refuse="drop")
    assert "ip saddr { 192.0.2.1 } tcp dport 22 accept" in narrow and "counter drop" in narrow


@pytest.mark.parametrize("host", ["board1", "lb"])
def test_the_rules_parse_and_load_in_nft(host, tmp_path):
    """nft itself checks the rendered file (in a network namespace of its own)."""
    nft, unshare = tool("nft"), tool("unshare")
    path = tmp_path / "nftables.conf"
    path.write_text(firewall(host))
    proc = subprocess.run([unshare, "--net", "sh", "-c", f"{nft} -f {path} && {nft} -f {path} && "
                           f"{nft} list chain inet appliance_firewall input"], capture_output=True, text=True)
    if proc.returncode != 0 and "Operation not permitted" in proc.stderr:
        pytest.skip("needs root (a network namespace)")
    assert proc.returncode == 0, proc.stderr
    assert "policy drop" in proc.stdout


def test_the_balancer_serves_tls_redirects_plain_http_and_guards_boards():
    site = render_role_template("loadbalancer", "appliance-site.conf.j2", groups={"boards": ["board1"]}, **ROUTES,
                                hostvars={"board1": {"ansible_host": "10.0.0.11"}})
    servers = site.split("\nserver {")
    assert len(servers) == 3, "expected the redirecting server and the API's"
    assert "return 308 https://$host$request_uri;" in servers[1] and "stub_status" in servers[1]
    assert "listen 443 ssl default_server;" in servers[2] and "listen 80 " not in servers[2]
    assert "ssl_protocols TLSv1.2 TLSv1.3;" in servers[2]
    board = re.search(r"location /boards/board1/ \{(.*?)\}", servers[2], re.S).group(1)
    assert re.search(r"satisfy any;\s+allow 127\.0\.0\.1;\s+deny all;", board), board
    assert "auth_basic" not in board, "no credentials configured: addresses only"
    both = render_role_template("loadbalancer", "appliance-site.conf.j2", groups={"boards": ["board1"]}, **ROUTES,
                                hostvars={"board1": {}}, loadbalancer_http="serve",
                                loadbalancer_boards_allow=["10.0.0.2"],
                                loadbalancer_boards_users=[{"name": "ops", "password": "x"}])
    assert "listen 80 default_server;" in both and "listen 443 ssl" in both and "return 308" not in both
    board = re.search(r"location /boards/board1/ \{(.*?)\}", both, re.S).group(1)
    assert re.search(r"satisfy any;\s+allow 10\.0\.0\.2;\s+deny all;\s+auth_basic \"appliance boards\";\s+"
                     r"auth_basic_user_file /etc/nginx/appliance-boards.htpasswd;", board), board


def test_the_fleet_ca_issues_verifiable_certificates_and_keeps_keys_in_the_vault(tmp_path):
    openssl, vault = tool("openssl"), tool("ansible-vault")
    password = tmp_path / "vault-password"
    password.write_text("static-test-password\n")
    pki = tmp_path / "pki"
    pki.mkdir()
    script = ANSIBLE_DIR / "roles/fleet_pki/files/fleet_pki.sh"

    def issue(*certs):
        return run(["bash", script, pki, password, vault, "test fleet CA", 3650, 397, 30, *certs]).stdout

    first = issue("lb=DNS:lb,IP:10.0.0.3")
    assert "issued CA" in first and "issued lb" in first
    assert issue("lb=DNS:lb,IP:10.0.0.3") == "", "a second run must issue nothing"
    assert "issued lb" in issue("lb=DNS:lb,DNS:llm.example.com,IP:10.0.0.3"), "renamed: issue again"
    run([openssl, "verify", "-CAfile", pki / "ca.crt", pki / "lb.crt"])
    text = run([openssl, "x509", "-in", pki / "lb.crt", "-noout", "-text"]).stdout
    assert "DNS:llm.example.com" in text and "IP Address:10.0.0.3" in text and "TLS Web Server Authentication" in text
    for key in ("ca.key.vault", "lb.key.vault"):
        assert (pki / key).read_text().startswith("$ANSIBLE_VAULT;")
    key = run([vault, "view", "--vault-password-file", password, pki / "lb.key.vault"]).stdout
    assert "PRIVATE KEY" in key
    assert not [p for p in pki.iterdir() if "PRIVATE KEY" in p.read_text(errors="replace")]


def test_every_package_is_pinned():
    lines = [l.strip() for l in (ANSIBLE_DIR / "files/apt-packages.txt").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines and all(re.match(r"^[a-z0-9][a-z0-9.+-]+=[0-9][\w.+~:-]*$", l) for l in lines), lines
    assert {"nftables", "prometheus-node-exporter", "nginx", "prometheus", "prometheus-alertmanager"} <= {
        l.split("=")[0] for l in lines}


FAKE_MADISON = {                     # what a controller's apt sources carry, `apt-cache madison` style
    "nginx": ["1.22.1-9+deb12u12", "1.22.1-9+deb12u9"],
    "nftables": ["1.0.6-2+deb12u2"],
    "prometheus": ["2.53.0-1"],      # only a new upstream: never taken for a 2.42 pin
}


def resolve_pins(tmp_path, pins: list[str], *flags: str) -> subprocess.CompletedProcess:
    """build_apt_repo.sh --resolve-only against a stand-in `apt-cache` (dpkg is the real one)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    lines = "\n".join(f"{name}) printf '%s\\n' {' '.join(repr(f' {name} | {v} | http://deb.debian.org/debian bookworm/main amd64 Packages') for v in versions)} ;;"
                      for name, versions in FAKE_MADISON.items())
    (fake / "apt-cache").write_text(f"#!/bin/sh\n[ \"$1\" = madison ] || exit 2\ncase \"$2\" in\n{lines}\nesac\n")
    (fake / "apt-cache").chmod(0o755)
    listing = tmp_path / "packages.txt"
    listing.write_text("# pins\n" + "".join(f"{p}\n" for p in pins))
    env = {"PATH": f"{fake}:/usr/bin:/bin"}
    return subprocess.run(["bash", ANSIBLE_DIR.parent / "scripts/lab/build_apt_repo.sh", "--resolve-only",
                           "--packages", listing, *flags], capture_output=True, text=True, env=env)


def test_a_pin_the_sources_carry_resolves_to_itself(tmp_path):
    out = resolve_pins(tmp_path, ["nftables=1.0.6-2+deb12u2", "nginx=1.22.1-9+deb12u9"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["nftables=1.0.6-2+deb12u2", "nginx=1.22.1-9+deb12u9"]


def test_a_pin_superseded_by_a_security_update_stops_the_build_and_names_the_update(tmp_path):
    out = resolve_pins(tmp_path, ["nginx=1.22.1-9+deb12u11"])
    assert out.returncode == 1 and out.stdout == ""
    assert "nginx 1.22.1-9+deb12u11 is superseded by 1.22.1-9+deb12u12" in out.stderr, out.stderr
    assert "--accept-updates" in out.stderr


def test_accept_updates_takes_the_newest_revision_of_the_same_upstream_version_with_a_warning(tmp_path):
    out = resolve_pins(tmp_path, ["nftables=1.0.6-2+deb12u2", "nginx=1.22.1-9+deb12u11"], "--accept-updates")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["nftables=1.0.6-2+deb12u2", "nginx=1.22.1-9+deb12u12"]
    assert "warning: nginx 1.22.1-9+deb12u11 is superseded by 1.22.1-9+deb12u12" in out.stderr


@pytest.mark.parametrize("pin", ["prometheus=2.42.0+ds-5+deb12u1", "nginx=1.22.1-9+deb12u13", "absent=1.0-1"])
def test_a_new_upstream_a_newer_pin_or_a_missing_package_is_never_substituted(tmp_path, pin):
    out = resolve_pins(tmp_path, [pin], "--accept-updates")
    name, version = pin.split("=")
    assert out.returncode == 1, out.stdout
    assert f"{name} {version} is not in this machine's apt sources" in out.stderr, out.stderr
