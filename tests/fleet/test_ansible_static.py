"""Static checks of the Ansible tree: lint, syntax, the canonical role layout."""
from __future__ import annotations

import re

import pytest
import yaml

from conftest import ANSIBLE_DIR, REPO, run, tool

PLAYBOOKS = ["site.yml", "rollout.yml", "bench.yml", "rotate_keys.yml"]
ROLES = sorted(p.name for p in (ANSIBLE_DIR / "roles").iterdir() if p.is_dir())


def load(path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def test_the_required_roles_exist():
    assert {"board", "appliance", "node_exporter", "prometheus", "alertmanager", "grafana",
            "loadbalancer"} <= set(ROLES)


def test_roles_have_one_path_systemd():
    """No home-made service manager and no branch on one: every service goes through systemd."""
    for path in ANSIBLE_DIR.rglob("*"):
        if path.is_file() and path.suffix in (".yml", ".j2", ".py", ".cfg"):
            text = path.read_text(encoding="utf-8")
            assert "supervisor" not in text.lower(), f"{path} still refers to a supervisor"
            assert not re.search(r"nginx -s|/etc/init.d|service\s+\w+\s+(start|restart)", text), path
    modules = set()
    for tasks in ANSIBLE_DIR.glob("roles/*/*/*.yml"):
        for task in load(tasks) or []:
            if isinstance(task, dict):
                modules |= {k for k in task if k.startswith("ansible.builtin.")}
    assert "ansible.builtin.systemd_service" in modules
    assert not modules & {"ansible.builtin.service", "ansible.builtin.sysvinit"}, modules


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
    argument_specs documents nothing that does not exist - but for a choice left unset by
    default (Ansible would check a null against the choices): optional, no default."""
    base = ANSIBLE_DIR / "roles" / role
    defaults = load(base / "defaults" / "main.yml") or {}
    specs = load(base / "meta" / "argument_specs.yml")["argument_specs"]["main"]
    options = specs.get("options", {})
    assert specs.get("short_description")
    for name in defaults:
        assert name.startswith(role + "_"), f"{role}: default {name} lacks the role prefix"
    unset = {name for name, spec in options.items()
             if spec.get("choices") and spec.get("required") is False and "default" not in spec}
    assert set(defaults) == set(options) - unset, \
        f"{role}: defaults and argument_specs differ: {set(defaults) ^ (set(options) - unset)}"
    for name, spec in options.items():
        assert spec.get("description"), f"{role}: {name} has no description"
        assert spec.get("type"), f"{role}: {name} has no type"


@pytest.mark.parametrize("role", ROLES)
def test_role_layout(role):
    base = ANSIBLE_DIR / "roles" / role
    first = "main.yml"
    while first != "preflight.yml":              # follow the first import: main -> (prepare ->) preflight
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


def test_each_instance_settings_file_lists_the_boards_instances_for_the_dashboard(tmp_path):
    """A board with several models: every instance's settings name all of them (the dashboard's
    list), and the file loads in the server's own settings reader; one instance: none."""
    config = pytest.importorskip("appliance.config")
    from conftest import render_role_template
    instances = [{"name": "chat", "port": 8080, "model_name": "Qwen3-1.7B"},
                 {"name": "embed", "port": 8081, "task": "embed", "served_model_name": "qwen3-embedding,emb"}]
    text = render_role_template("appliance", "appliance.yml.j2", appliance_instances=instances,
                                appliance_instance="{{ appliance_instance_list[1] }}")
    (tmp_path / "embed.yml").write_text(text)
    settings = config.load_settings(str(tmp_path / "embed.yml"), environ={})
    assert settings.port == 8081 and config.board_instances(settings) == [
        {"name": "chat", "port": 8080, "task": None, "model": "Qwen3-1.7B"},
        {"name": "embed", "port": 8081, "task": "embed", "model": "qwen3-embedding"}]
    single = yaml.safe_load(render_role_template("appliance", "appliance.yml.j2",
                                                 appliance_instance="{{ appliance_instance_list[0] }}"))
    assert single["board_instances"] is None


def test_the_settings_file_and_the_api_key_are_never_logged():
    tasks = load(ANSIBLE_DIR / "roles/appliance/tasks/configure.yml")
    settings = next(t for t in tasks if "appliance.yml" in str(t.get("ansible.builtin.template", {})))
    assert settings.get("no_log") is True


def test_unit_hardening_and_pinning():
    unit = (ANSIBLE_DIR / "roles/appliance/templates/appliance.service.j2").read_text(encoding="utf-8")
    for directive in ("CPUAffinity=", "Slice=appliance.slice", "Restart=on-failure", "MemoryMax=",
                      "NoNewPrivileges=yes", "ProtectSystem=strict", "User={{ appliance_user }}", "ProtectHome=yes", "PrivateTmp=yes"):
        assert directive in unit, directive
    # the weight is the slice's: the kernel weighs it against system.slice and user.slice
    slice_unit = (ANSIBLE_DIR / "roles/appliance/templates/appliance.slice.j2").read_text(encoding="utf-8")
    assert "[Slice]\nCPUWeight={{ appliance_cpu_weight }}" in slice_unit


def test_cpu_weights_and_the_build_cpus_are_checked_before_anything_runs():
    """The preflight refuses a weight systemd would drop (1-10000) and a CPU list taskset would not take."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from conftest import trusted
    tasks = load(ANSIBLE_DIR / "roles/appliance/tasks/preflight.yml")
    that = next(t for t in tasks if t["name"] == "Check the CPU settings")["ansible.builtin.assert"]["that"]

    def accepted(**settings) -> bool:
        variables = {"appliance_cpu_weight": 1000, "appliance_build_cpu_weight": 10, "appliance_build_cpus": ""}
        variables.update(settings)
        templar = Templar(loader=DataLoader(), variables=trusted(variables))
        return all(templar.template(trusted("{{ " + condition + " }}")) for condition in that)

    assert accepted() and accepted(appliance_build_cpus="0-3") and accepted(appliance_build_cpus="0,2-3")
    for bad in ({"appliance_cpu_weight": 0}, {"appliance_cpu_weight": 10001}, {"appliance_build_cpu_weight": "x"},
                {"appliance_build_cpus": "0-"}, {"appliance_build_cpus": "A55"}, {"appliance_build_cpus": "0,,1"}):
        assert not accepted(**bad), bad


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


def test_every_restart_of_the_appliance_is_a_rollout():
    """site.yml reaches the boards only through rollout.yml; rollout.yml batches with the ramp
    from vars/rollout.yml, stops at the first failure, drains before and undrains after."""
    site = load(ANSIBLE_DIR / "site.yml")
    board_plays = [p for p in site if "hosts" in p and "boards" in str(p["hosts"])]
    assert not board_plays, "site.yml must not run a play of its own on the boards"
    assert {"ansible.builtin.import_playbook": "rollout.yml"}.items() <= next(
        p for p in site if "ansible.builtin.import_playbook" in p).items()
    prepare, deploy = load(ANSIBLE_DIR / "rollout.yml")
    defaults = load(ANSIBLE_DIR / "vars/rollout.yml")
    assert defaults["fleet_rollout_batches"] == [1, "10%", "50%"]
    assert prepare["max_fail_percentage"] == "{{ fleet_rollout_max_unreachable_percent }}"
    assert "serial" not in prepare and deploy["serial"] == "{{ fleet_rollout_batches }}"
    assert deploy["max_fail_percentage"] == 0
    assert "vars/rollout.yml" in prepare["vars_files"] and "vars/rollout.yml" in deploy["vars_files"]
    steps = [(t.get("ansible.builtin.include_role") or {}).get("tasks_from") for t in
             deploy["pre_tasks"] + deploy["tasks"] + deploy["post_tasks"]]
    assert [s for s in steps if s] == ["drain", "drain", "deploy", "drain"], steps
    stop = deploy["post_tasks"][-1]
    assert stop.get("any_errors_fatal") is True and "ansible.builtin.fail" in stop


def test_the_deploy_rolls_back_on_a_failed_gate():
    deploy = load(ANSIBLE_DIR / "roles/appliance/tasks/deploy.yml")
    block = next(t for t in deploy if "block" in t)

    def imports(tasks):
        for t in tasks:
            yield from imports(t["block"]) if "block" in t else [t.get("ansible.builtin.import_tasks")]

    imported = list(imports(block["block"]))
    assert imported.index("activate.yml") < imported.index("service.yml") < imported.index("verify.yml") \
        < imported.index("cleanup.yml")
    rescue = str(block["rescue"])
    assert "rollback.yml" in rescue
    rollback = load(ANSIBLE_DIR / "roles/appliance/tasks/rollback.yml")
    assert "appliance_previous_release" in str(rollback) and "verify.yml" in str(rollback)


def test_the_alertmanager_config_from_the_example_inventory_routes_by_severity(tmp_path):
    """The role's template with the example inventory: amtool accepts it, and each severity
    reaches the receiver the inventory names (the Watchdog its dead man's switch)."""
    from conftest import render_role_template
    amtool = tool("amtool")
    group_vars = ANSIBLE_DIR / "inventories/example/group_vars/monitoring"
    config = tmp_path / "alertmanager.yml"
    config.write_text(render_role_template("alertmanager", "alertmanager.yml.j2", group_vars / "main.yml",
                                           group_vars / "vault.yml.example"))
    text = config.read_text()
    assert "replace-with-the-relay-password" in text and "pager.example.com" in text
    run([amtool, "check-config", config])
    for labels, receiver in [(["severity=critical", "alertname=FleetBoardsReadyLow"], "oncall"),
                             (["severity=warning", "alertname=BoardDown"], "team"),
                             (["severity=info", "alertname=BoardAttentionShareHigh"], "team"),
                             (["severity=none", "alertname=Watchdog"], "deadmansswitch")]:
        run([amtool, "config", "routes", "test", f"--config.file={config}", f"--verify.receivers={receiver}", *labels])
    bad = run([amtool, "config", "routes", "test", f"--config.file={config}", "--verify.receivers=oncall",
               "severity=warning"], check=False)
    assert bad.returncode != 0, "a warning must not page"


def test_the_fleet_thresholds_come_from_the_inventory(tmp_path):
    from conftest import render_role_template
    promtool = tool("promtool")
    rules = tmp_path / "fleet-thresholds.yml"
    rules.write_text(render_role_template("prometheus", "fleet-thresholds.yml.j2",
                                          prometheus_fleet_min_ready_boards=7, prometheus_fleet_decode_p95_ms=180))
    run([promtool, "check", "rules", rules])
    records = {r["record"]: r["expr"] for g in load(rules)["groups"] for r in g["rules"]}
    assert records == {"fleet:appliance_boards_ready:min_threshold": "vector(7)",
                       "fleet:appliance_decode_ms_per_token_p95:max_threshold": "vector(180.0)"}


def render_upstreams(**balancer) -> str:
    from conftest import render_role_template
    boards = {"board1": {"ansible_host": "10.0.0.11"}, "board2": {"ansible_host": "10.0.0.12"}}
    return render_role_template("loadbalancer", "upstreams.conf.j2", groups={"boards": sorted(boards)},
                                hostvars={"lb": balancer, **boards}, loadbalancer_target="lb",
                                loadbalancer_down_states={"lb": {"board2": {"since": 1, "by": "rollout"}}})


def test_the_upstream_hashes_sessions_consistently_and_keeps_drained_boards_out():
    """A session key (header, else API key, else address) picks the board through nginx's
    consistent hash, so a drained board moves only its own sessions; without affinity the
    boards share by least connections."""
    from conftest import render_role_template
    upstreams = render_upstreams()
    assert "hash $appliance_session_key consistent;" in upstreams and "least_conn" not in upstreams
    assert re.search(r"server 10\.0\.0\.12:8080 .* down;", upstreams)
    assert "least_conn;" in render_upstreams(loadbalancer_session_affinity=False)
    site = render_role_template("loadbalancer", "appliance-site.conf.j2", groups={"boards": ["board1"]},
                                hostvars={"board1": {}}, loadbalancer_session_header="X-Conversation",
                                loadbalancer_fleet_routes={"by_model": False, "upstreams": {}})
    maps = dict(re.findall(r"map (\$\S+) (\$\S+) \{", site))
    assert maps == {"$http_authorization": "$appliance_client_key",
                    "$http_x_conversation": "$appliance_session_key"}, maps
    assert '"session:$http_x_conversation"' in site and '""      $appliance_client_key;' in site
    assert '"address:$remote_addr"' in site


@pytest.mark.parametrize("grace", [0, 5, 30, 120])
def test_a_drained_stop_has_time_to_save_the_kv_disk_tier(grace):
    """systemd's stop timeout covers the server's own: the grace period for running requests,
    then the prefix cache's save to disk for up to as long again."""
    from conftest import render_role_template
    unit = render_role_template("appliance", "appliance.service.j2", appliance_grace_period=grace)
    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1))
    assert stop >= 2 * grace + 5
    assert stop > int(2 * max(grace, 5.0)) + 5, "gunicorn's graceful timeout must end before systemd's SIGKILL"


def test_the_kv_disk_tier_is_writable_by_the_service_only_when_set():
    from conftest import render_role_template
    assert "ReadWritePaths" not in render_role_template("appliance", "appliance.service.j2")
    unit = render_role_template("appliance", "appliance.service.j2", appliance_kv_cache_dir="/var/cache/appliance-kv")
    assert "ReadWritePaths=/var/cache/appliance-kv" in unit.splitlines()
    settings = yaml.safe_load(render_role_template("appliance", "appliance.yml.j2", appliance_kv_cache_dir="/x",
                                                   appliance_kv_cache_memory="40%", appliance_max_step_tokens=256,
                                                   appliance_instance="{{ appliance_instance_list[0] }}"))
    assert (settings["kv_cache_dir"], settings["kv_cache_memory"], settings["max_step_tokens"],
            settings["kv_cache_disk_bytes"]) == ("/x", "40%", 256, 4 << 30)
