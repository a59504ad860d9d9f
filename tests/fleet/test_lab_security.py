"""The fleet behind a locked door, in the lab (tests/fleet/fleetlab.py): the boards' firewall
(the API and node_exporter only for the load balancer and the monitoring host), hosts without
a route to any registry that install their packages from the controller's signed APT
repository, TLS at the load balancer with the fleet CA, /boards/ for the monitoring network or
a credential, named API keys rotated without a restart, targets discovered from files, and
Grafana's secrets from the vault. Runs on the lab the other lab tests converged (or converges
it when run alone)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from conftest import ANSIBLE_DIR
from fleetlab import API_KEY, BOARDS, LAB_DIR, LB, STEPS, VAULT_PASSWORD_FILE, board_file

pytestmark = [pytest.mark.fleet, pytest.mark.slow]
ADDRESS = {"board1": "10.78.0.11", "board2": "10.78.0.12", "board3": "10.78.0.13", "mon": "10.78.0.2",
           "lb": "10.78.0.3"}
CURL_REFUSED = 7            # curl: failed to connect (the firewall's TCP reset)


@pytest.fixture(scope="module")
def fleet(lab):
    """The lab with site.yml converged (by test_lab.py, or here when this file runs alone)."""
    if not STEPS.get("site"):
        rc, out = lab.playbook("site.yml", "-e", f"appliance_source_dir={LAB_DIR / 'src-v1'}")
        assert rc == 0, out[-8000:]
        STEPS["site"] = True
    return lab


def curl(lab, host: str | None, url: str, *args: str) -> tuple[int, str]:
    """(curl's exit code, HTTP status) of a GET from a lab host (None: the controller)."""
    argv = ["curl", "-s", "-o", "/dev/null", "-m", "5", "-w", "%{http_code}", *args, url]
    if host is None:
        proc = lab.ns(argv, timeout=30)
        return proc.returncode, proc.stdout
    proc = lab.on(host, "sh", "-c", " ".join(f"'{a}'" for a in argv) + "; echo \" rc=$?\"", check=False, timeout=30)
    code, _, rc = proc.strip().rpartition(" rc=")
    return int(rc), code


def scrape_password() -> str:
    return vaulted("all", "vault_fleet_scrape_password")


def test_boards_serve_the_api_and_node_exporter_only_to_the_load_balancer_and_monitoring(fleet):
    target = ADDRESS["board1"]
    api, exporter = f"http://{target}:8080/health", f"https://{target}:9100/metrics"
    prometheus = ("--cacert", "/etc/prometheus/fleet-ca.crt", "-u", f"prometheus:{scrape_password()}")
    for stranger in ("board2", None):                 # another board, the controller
        for url in (api, exporter):
            rc, _ = curl(fleet, stranger, url)
            assert rc == CURL_REFUSED, f"{stranger or 'controller'} -> {url}: curl exit {rc}, not refused"
    assert curl(fleet, "lb", api) == (0, "200"), "the load balancer cannot reach the board's API"
    assert curl(fleet, "mon", api) == (0, "200"), "the monitoring host cannot reach the board's API"
    assert curl(fleet, "mon", exporter, *prometheus) == (0, "200"), "the monitoring host cannot scrape node_exporter"
    assert curl(fleet, "lb", exporter, "-k")[0] == CURL_REFUSED, "node_exporter is open to the load balancer"
    for board in BOARDS:
        rules = fleet.on(board, "nft", "list", "chain", "inet", "appliance_firewall", "input")
        assert "policy drop" in rules and "tcp dport 22 accept" in rules, rules
        assert re.search(r"ip saddr \{ 10\.78\.0\.[23], 10\.78\.0\.[23] \} tcp dport 8080 accept", rules), rules
        assert fleet.unit(board, "nftables.service", "UnitFileState")["UnitFileState"] == "enabled"
    # the load balancer's own API port stays open to everyone
    assert curl(fleet, None, "http://10.78.0.3/boards/board1/ready")[1] in ("200", "401")


def test_no_host_reaches_a_registry_and_packages_come_from_the_controller(fleet):
    pinned = dict(line.split("=", 1) for line in (ANSIBLE_DIR / "files/apt-packages.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))
    rootfs = Path(os.environ.get("FLEET_ROOTFS", "/var/cache/appliance-fleet/rootfs")).resolve()
    assert not (rootfs / "usr/sbin/nft").exists(), "nftables is in the image: the test would prove nothing"
    for host in [*BOARDS, "lb"]:
        for url in ("http://deb.debian.org/debian/dists/bookworm/InRelease", "https://pypi.org/simple/pip/",
                    "http://151.101.2.132/"):                   # a name, and an address (no DNS needed)
            rc, _ = curl(fleet, host, url)
            assert rc != 0, f"{host} fetched {url}"
        sources = fleet.on(host, "sh", "-c", "grep -rh '^[^#]' /etc/apt/sources.list /etc/apt/sources.list.d/ || true")
        assert re.findall(r"^URIs: (\S+)", sources, re.M) == ["http://10.78.0.1:8082/"], sources
        assert "deb.debian.org" not in sources
        update = fleet.on(host, "apt-get", "update", timeout=120)
        assert "10.78.0.1:8082" in update and "NO_PUBKEY" not in update, update
    # What the controller serves: the pin, or the Debian update that superseded it (the lab
    # builds with --accept-updates, so a security release does not break it).
    served = dict(line.split(" ", 1) for line in (Path(os.environ.get(
        "FLEET_APT_REPO", "/var/cache/appliance-fleet/apt-repo")) / "repo/manifest.txt").read_text().splitlines())
    assert served["nftables"].rsplit("-", 1)[0] == pinned["nftables"].rsplit("-", 1)[0], (served, pinned)
    for board in BOARDS:
        version = fleet.on(board, "dpkg-query", "-W", "-f=${Version}", "nftables").strip()
        assert version == served["nftables"], f"{board}: nftables {version}, served {served['nftables']}"
        policy = fleet.on(board, "apt-cache", "policy", "nftables")
        assert re.search(rf"\*\*\* {re.escape(version)} \d+\n\s+\d+ http://10\.78\.0\.1:8082 \./", policy), policy
    assert board_file("board1", "/var/lib/apt/appliance-fleet.InRelease").read_text().startswith(
        "-----BEGIN PGP SIGNED MESSAGE-----")


def vaulted(group: str, name: str) -> str:
    """A !vault value of the lab's group_vars/<group>.yml, decrypted with the lab's password."""
    import yaml
    from ansible.parsing.vault import VaultLib, VaultSecret

    class Loader(yaml.SafeLoader):
        pass
    Loader.add_constructor("!vault", lambda loader, node: "!vault " + loader.construct_scalar(node))
    value = yaml.load((ANSIBLE_DIR / f"inventories/lab/group_vars/{group}.yml").read_text(), Loader=Loader)[name]
    assert value.startswith("!vault $ANSIBLE_VAULT;"), f"{name} is not vault-encrypted"
    secret = VaultSecret(VAULT_PASSWORD_FILE.read_text().strip().encode())
    return VaultLib([("default", secret)]).decrypt(value.removeprefix("!vault ")).decode()


def test_the_load_balancer_speaks_tls_with_a_certificate_of_the_fleet_ca(fleet):
    pki = LAB_DIR / "pki"
    ca = pki / "ca.crt"
    assert ca.is_file(), "no fleet CA on the controller"
    for key in pki.glob("*.key*"):
        assert key.read_text().startswith("$ANSIBLE_VAULT;"), f"{key} is not vault-encrypted"
    assert not [p for p in pki.iterdir() if "PRIVATE KEY" in p.read_text(errors="replace")]
    url = "https://10.78.0.3/v1/models"
    auth = ["-H", f"Authorization: Bearer {API_KEY}"]
    verified = fleet.ns(["curl", "-s", "-m", "10", "--cacert", ca, "-w", "\n%{http_code} %{ssl_verify_result}",
                         *auth, url])
    assert verified.returncode == 0 and verified.stdout.endswith("\n200 0"), verified.stdout[-300:] + verified.stderr
    unverified = fleet.ns(["curl", "-s", "-m", "10", *auth, url])      # the system's CAs do not know it
    assert unverified.returncode == 60, f"curl exit {unverified.returncode}: the certificate verified without the CA"
    keyless = fleet.ns(["curl", "-s", "-m", "10", "--cacert", ca, "-o", "/dev/null", "-w", "%{http_code}", url])
    assert keyless.stdout == "401"
    chain = fleet.ns(["openssl", "s_client", "-connect", "10.78.0.3:443", "-CAfile", ca, "-verify_return_error",
                      "-brief"], input="", timeout=30)
    assert chain.returncode == 0 and "Verification: OK" in chain.stdout + chain.stderr, chain.stderr[-500:]
    mode = fleet.on("lb", "stat", "-c", "%a %U", "/etc/nginx/tls/appliance.key").strip()
    assert mode == "600 root", mode


def test_boards_on_the_load_balancer_need_the_monitoring_network_or_a_credential(fleet):
    password = vaulted("loadbalancer", "vault_loadbalancer_boards_password")
    url = "http://10.78.0.3/boards/board1/health"
    assert curl(fleet, "board2", url) == (0, "401"), "a board reached /boards/ without a credential"
    assert curl(fleet, "mon", url) == (0, "200"), "the monitoring host was refused /boards/"
    with_credential = fleet.on("board2", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", "5",
                               "-u", f"fleet-ops:{password}", url)
    assert with_credential == "200"
    wrong = fleet.on("board2", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", "5",
                     "-u", "fleet-ops:not-the-password", url)
    assert wrong == "401"
    htpasswd = board_file("lb", "/etc/nginx/appliance-boards.htpasswd").read_text()
    assert htpasswd.startswith("fleet-ops:$6$") and password not in htpasswd


def test_rotating_the_keys_revokes_one_at_once_without_a_restart_or_a_failed_request(fleet):
    """rotate_keys.yml with lab-client-b revoked and lab-client-c added, while lab-client-a
    streams 200-token answers through the load balancer."""
    a, b = (vaulted("all", f"vault_lab_client_{k}_key") for k in ("a", "b"))
    c = "lab-client-c-key-0003"

    def status(board: str, key: str) -> int:
        return fleet.get(f"{LB}/boards/{board}/v1/models", {"Authorization": f"Bearer {key}"})[0]

    assert all(status(board, key) == 200 for board in BOARDS for key in (a, b))
    assert status("board1", c) == 401
    rotated = LAB_DIR / "rotate-keys.json"
    rotated.write_text(json.dumps({"appliance_api_keys": [{"name": "lab-client-a", "key": a},
                                                          {"name": "lab-client-c", "key": c}]}))
    started = {board: fleet.unit(board, "appliance.service", "ActiveEnterTimestamp") for board in BOARDS}
    loop = fleet.client_loop("rotate-client", max_seconds=600, pause=0.2, api_key=a)
    try:
        rc, out = fleet.playbook("rotate_keys.yml", "-e", f"@{rotated}")
        revoked_at_once = {board: status(board, b) for board in BOARDS}
    finally:
        stats = fleet.finish(loop)
    assert rc == 0, out[-6000:]
    assert stats["failed"] == 0 and stats["cut"] == 0 and stats["ok"] >= 2, stats
    assert revoked_at_once == {board: 401 for board in BOARDS}, revoked_at_once
    assert all(status(board, key) == 200 for board in BOARDS for key in (a, c))
    assert {board: fleet.unit(board, "appliance.service", "ActiveEnterTimestamp") for board in BOARDS} == started
    keys = json.loads(board_file("board1", "/etc/appliance/api-keys.json").read_text())
    assert set(keys) == {"lab-client-a", "lab-client-c"}
    journal = fleet.on("board1", "journalctl", "-u", "appliance.service", "--no-pager", "-o", "cat")
    assert re.search(r"GET /v1/models 200 [\d.]+ ms client=lab-client-c", journal), journal[-2000:]
    assert re.search(r"GET /v1/models 401 [\d.]+ ms client=-", journal)
    assert not any(key in journal for key in (a, b, c)), "a key reached the journal"
    code, metrics = fleet.get(f"{LB}/boards/board1/metrics")
    assert code == 200 and re.search(r'appliance_client_requests_total\{client="lab-client-c",status="2xx"\} [1-9]',
                                     metrics), metrics[-2000:]


def test_a_board_added_to_the_inventory_is_scraped_without_a_reload(fleet):
    """board4 (an address nobody answers at) joins the inventory: its targets show up in
    Prometheus from the file_sd files, with neither a reload nor a restart; it leaves again."""
    inventory = LAB_DIR / "board4" / "hosts.yml"
    inventory.parent.mkdir(exist_ok=True)
    inventory.write_text("all:\n  children:\n    boards:\n      hosts:\n        board4: {ansible_host: 10.78.0.14}\n")
    config = 'prometheus_config_last_reload_success_timestamp_seconds{job="prometheus"}'
    started = 'process_start_time_seconds{job="prometheus"}'
    before = {q: fleet.query(q)[0]["value"][1] for q in (config, started)}
    try:
        rc, out = fleet.playbook("site.yml", "--limit", "mon", inventories=[inventory])
        assert rc == 0, out[-6000:]
        assert "Reload prometheus" not in out and "Restart prometheus" not in out
        def board4_jobs():
            found = {r["metric"]["job"] for r in fleet.query('up{instance="board4"}')}
            return found if found >= {"appliance", "node"} else None

        jobs = fleet.wait_for("board4's targets", board4_jobs, timeout=90)
        print(f"board4 discovered: {sorted(jobs)}")
        board4 = fleet.query('up{instance="board4", job="appliance"}')[0]["metric"]
        assert board4.get("board") == "board4"
        assert {q: fleet.query(q)[0]["value"][1] for q in (config, started)} == before, "Prometheus reloaded"
    finally:
        rc, out = fleet.playbook("site.yml", "--limit", "mon")
        assert rc == 0, out[-6000:]
    fleet.wait_for("board4 gone", lambda: not fleet.query('up{instance="board4"}'), timeout=90)
    targets = json.loads(board_file("mon", "/etc/prometheus/file_sd/appliance.json").read_text())
    assert sorted(t["labels"]["instance"] for t in targets) == BOARDS


def test_grafana_gets_its_admin_password_and_secret_key_from_the_vault(fleet):
    env = fleet.on("mon", "cat", "/etc/grafana/appliance-secrets.env")
    assert f'GF_SECURITY_ADMIN_PASSWORD="{vaulted("monitoring", "vault_grafana_admin_password")}"' in env
    assert f'GF_SECURITY_SECRET_KEY="{vaulted("monitoring", "vault_grafana_secret_key")}"' in env
    assert fleet.on("mon", "stat", "-c", "%a %U", "/etc/grafana/appliance-secrets.env").strip() == "600 root"
    dropin = fleet.on("mon", "cat", "/etc/systemd/system/grafana-server.service.d/appliance-secrets.conf")
    assert "EnvironmentFile=/etc/grafana/appliance-secrets.env" in dropin


def test_prometheus_scrapes_node_exporter_and_the_boards_over_tls_with_basic_auth(fleet):
    """node_exporter answers HTTPS with its fleet-CA certificate and wants the credential; the
    appliance's /metrics come through the load balancer's /boards/ over HTTPS; every target up."""
    code, body = fleet.get("http://10.78.0.2:9090/api/v1/targets?state=active")
    assert code == 200
    targets = json.loads(body)["data"]["activeTargets"]
    by_job: dict[str, dict[str, dict]] = {}
    for t in targets:
        by_job.setdefault(t["labels"]["job"], {})[t["labels"]["instance"]] = t
    for board in BOARDS:
        appliance = by_job["appliance"][board]
        assert appliance["scrapeUrl"] == f"https://10.78.0.3:443/boards/{board}/metrics", appliance["scrapeUrl"]
        node = by_job["node"][board]
        assert node["scrapeUrl"] == f"https://{ADDRESS[board]}:9100/metrics"
    fleet.wait_for("every TLS target up", lambda: all(
        t["health"] == "up" for t in json.loads(fleet.get("http://10.78.0.2:9090/api/v1/targets?state=active")[1])[
            "data"]["activeTargets"] if t["labels"]["job"] in ("appliance", "node")), timeout=60)
    exporter = f"https://{ADDRESS['board1']}:9100/metrics"
    ca = ("--cacert", "/etc/prometheus/fleet-ca.crt")
    assert curl(fleet, "mon", exporter, *ca) == (0, "401"), "node_exporter answered without a credential"
    assert curl(fleet, "mon", exporter, *ca, "-u", "prometheus:wrong-password") == (0, "401")
    assert curl(fleet, "mon", exporter.replace("https", "http"))[1] == "400", "node_exporter speaks plain HTTP"
    web = fleet.on("board1", "cat", "/etc/prometheus/node-exporter/web.yml")
    assert re.search(r'prometheus: "\$2[aby]\$10\$', web) and scrape_password() not in web


def test_series_per_board_stay_within_the_budget_for_a_thousand_boards(fleet):
    """What one board costs Prometheus (the appliance's series and node_exporter's with the
    trimmed collectors), printed for docs/fleet.md's arithmetic; a budget keeps it there."""
    per_job = {r["metric"]["job"]: int(r["value"][1])
               for r in fleet.query('count by (job) ({board="board1", job=~"appliance|node"})')}
    for host in ("lb", "mon"):
        per_job[f"node ({host})"] = int(fleet.query(f'count({{job="node", instance="{host}"}})')[0]["value"][1])
    print(f"series per host: {per_job}; a board: {per_job['appliance'] + per_job['node']}")
    assert per_job["node"] <= 550, f"node_exporter on a board: {per_job['node']} series (collectors trimmed?)"
    assert per_job["appliance"] + per_job["node"] <= 900, per_job
