"""Static checks of the Ansible tree: lint, syntax, the canonical role layout."""
from __future__ import annotations

import re

import pytest
import yaml

from conftest import ANSIBLE_DIR, REPO, run, tool

PLAYBOOKS = ["site.yml", "rollout.yml", "bench.yml"]
ROLES = sorted(p.name for p in (ANSIBLE_DIR / "roles").iterdir() if p.is_dir())


def load(path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def test_the_required_roles_exist():
    assert {"board", "appliance", "node_exporter", "prometheus", "grafana", "loadbalancer"} <= set(ROLES)


def test_ansible_lint_production_profile_is_clean():
    lint = tool("ansible-lint")
    proc = run([lint, "--offline", "--profile", "production", "--nocolor"], cwd=ANSIBLE_DIR, check=False,
               timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbook_syntax(playbook):
    ansible_playbook = tool("ansible-playbook")
    run([ansible_playbook, "--syntax-check", "-i", "inventories/example/hosts.yml", playbook], cwd=ANSIBLE_DIR)


@pytest.mark.parametrize("role", ROLES)
def test_role_defaults_are_prefixed_and_documented(role):
    """Every default is prefixed with the role name and documented in argument_specs, and
    argument_specs documents nothing that does not exist."""
    base = ANSIBLE_DIR / "roles" / role
    defaults = load(base / "defaults" / "main.yml") or {}
    specs = load(base / "meta" / "argument_specs.yml")["argument_specs"]["main"]
    options = specs.get("options", {})
    assert specs.get("short_description")
    for name in defaults:
        assert name.startswith(role + "_"), f"{role}: default {name} lacks the role prefix"
    assert set(defaults) == set(options), f"{role}: defaults and argument_specs differ: {set(defaults) ^ set(options)}"
    for name, spec in options.items():
        assert spec.get("description"), f"{role}: {name} has no description"
        assert spec.get("type"), f"{role}: {name} has no type"


@pytest.mark.parametrize("role", ROLES)
def test_role_layout(role):
    base = ANSIBLE_DIR / "roles" / role
    if role != "supervisor":
        first = "main.yml"
        while first != "preflight.yml":          # follow the first import: main -> (prepare ->) preflight
            tasks = load(base / "tasks" / first)
            first = tasks[0].get("ansible.builtin.import_tasks")
            assert first, f"{role}: tasks/main.yml must start with the preflight checks"
    for template in (base / "templates").glob("*.j2") if (base / "templates").exists() else []:
        head = template.read_text(encoding="utf-8").splitlines()[:3]
        assert any("{{ ansible_managed }}" in line for line in head), f"{template}: no ansible_managed header"
    handlers = base / "handlers" / "main.yml"
    for handler in (load(handlers) or []) if handlers.exists() else []:
        name = handler.get("listen", handler["name"])
        assert re.match(r"^(Restart|Reload) [\w.-]+$", name), f"{role}: handler {name!r} is not named for its service"


def test_settings_template_uses_only_keys_the_server_knows():
    """The settings file the role writes must load: its keys are appliance.config's keys."""
    config = pytest.importorskip("appliance.config")
    text = (ANSIBLE_DIR / "roles/appliance/templates/appliance.yml.j2").read_text(encoding="utf-8")
    keys = re.findall(r"^([a-z_]+):", text, flags=re.M)
    assert {"model", "host", "port", "weights", "kv", "threads", "sparse_attn", "api_key"} <= set(keys)
    unknown = set(keys) - set(config.KEYS)
    assert not unknown, f"settings keys unknown to appliance.config: {unknown}"


def test_the_settings_file_and_the_api_key_are_never_logged():
    tasks = load(ANSIBLE_DIR / "roles/appliance/tasks/configure.yml")
    settings = next(t for t in tasks if "appliance.yml" in str(t.get("ansible.builtin.template", {})))
    assert settings.get("no_log") is True


def test_unit_hardening_and_pinning():
    unit = (ANSIBLE_DIR / "roles/appliance/templates/appliance.service.j2").read_text(encoding="utf-8")
    for directive in ("CPUAffinity=", "Restart=on-failure", "MemoryMax=", "NoNewPrivileges=yes",
                      "ProtectSystem=strict", "User={{ appliance_user }}", "ProtectHome=yes", "PrivateTmp=yes"):
        assert directive in unit, directive


def test_example_inventory_has_the_three_groups():
    inventory = load(ANSIBLE_DIR / "inventories/example/hosts.yml")
    assert set(inventory["all"]["children"]) == {"boards", "monitoring", "loadbalancer"}


def test_vagrantfile_validates_and_names_existing_playbooks():
    vagrant = tool("vagrant")
    proc = run([vagrant, "validate", "--ignore-provider"], cwd=REPO, env={"VAGRANT_CHECKPOINT_DISABLE": "1"})
    assert "validated successfully" in proc.stdout
    text = (REPO / "Vagrantfile").read_text(encoding="utf-8")
    playbooks = re.findall(r'\.playbook\s*=\s*"([^"]+)"', text)
    assert playbooks, "the Vagrantfile provisions with no playbook"
    for playbook in playbooks:
        assert (REPO / playbook).is_file(), f"Vagrantfile names {playbook}, which does not exist"
    config_files = re.findall(r'\.config_file\s*=\s*"([^"]+)"', text)
    for config_file in config_files:
        assert (REPO / config_file).is_file()
