"""Fleet tests: static checks of ansible/, monitoring/, Vagrantfile (fast, unmarked) and
the network-namespace lab (marked fleet + slow).

Tools come from scripts/ci/install_fleet_deps.sh. Where one is missing the test is
skipped, unless FLEET_REQUIRE_TOOLS=1 (scripts/ci/test_fleet.sh sets it): then it fails.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = REPO / "ansible"
MONITORING = REPO / "monitoring"
VENV_BIN = Path(sys.executable).parent
DASHBOARD = MONITORING / "grafana" / "dashboards" / "fleet.json"


def tool(name: str) -> str:
    """Path of a tool (the venv's bin first); skip, or fail under FLEET_REQUIRE_TOOLS=1."""
    path = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin")
    if path is None:
        message = f"{name} not installed (scripts/ci/install_fleet_deps.sh)"
        if os.environ.get("FLEET_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def run(argv, cwd=None, timeout=600, env=None, check=True) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {}))
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, argv))} exited {proc.returncode}\n"
                    f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


def trusted(value):
    """YAML data as Ansible would template it (ansible-core 2.19 renders trusted strings only)."""
    try:
        from ansible.template import trust_as_template
    except ImportError:                       # older ansible-core renders every string
        return value
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, dict):
        return {k: trusted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [trusted(v) for v in value]
    return value


def render_role_template(role: str, template: str, *var_files: Path, **extra) -> str:
    """A role's template rendered by Ansible's own templar with the role's filters, its
    defaults, then var_files (inventory group_vars, in order), then its vars, then extra; no
    hosts involved."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.plugins.loader import filter_loader
    from ansible.template import Templar

    import yaml
    base = ANSIBLE_DIR / "roles" / role
    if (base / "filter_plugins").is_dir():
        filter_loader.add_directory(str(base / "filter_plugins"))
    variables = yaml.safe_load((base / "defaults" / "main.yml").read_text(encoding="utf-8")) or {}
    for f in var_files:
        variables.update(yaml.safe_load(Path(f).read_text(encoding="utf-8")) or {})
    if (base / "vars" / "main.yml").is_file():
        variables.update(yaml.safe_load((base / "vars" / "main.yml").read_text(encoding="utf-8")) or {})
    variables.update(extra)
    variables.setdefault("ansible_managed", "Ansible managed")
    templar = Templar(loader=DataLoader(), variables=trusted(variables))
    return templar.template(trusted((base / "templates" / template).read_text(encoding="utf-8")))


def dashboard_queries(annotations: bool = True) -> list[tuple[str, str]]:
    """(panel title, expr) of every panel target (and of the alert annotation)."""
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    out = [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]
    if annotations:
        out += [("annotation " + a["name"], a["expr"]) for a in board["annotations"]["list"] if a.get("expr")]
    return out


def concrete(expr: str) -> str:
    """A dashboard expression with Grafana's variables filled in, as Grafana would send it."""
    return expr.replace("$__rate_interval", "1m").replace("$board", ".+")


@pytest.fixture(scope="session")
def lab():
    """The simulated fleet (tests/fleet/fleetlab.py), brought up once for every lab test."""
    import fleetlab
    yield from fleetlab.bring_up()
