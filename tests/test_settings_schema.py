"""Every setting is defined once (appliance/config.py): the flags, the settings file and the
Ansible role's argument specs all agree with that one definition."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from appliance.cli import build_parser
from appliance.cli.args import ENGINE_KEYS
from appliance.config import FIELDS, KEYS, Settings, add_setting_flags, flag_name

ROLE = Path(__file__).resolve().parents[1] / "ansible" / "roles" / "appliance"
# Where a board's role chooses differently from the server's default, and why.
BOARD_DEFAULTS = {
    "host": "0.0.0.0",     # behind the load balancer, not loopback
    "threads": 4,          # the RK3588's four Cortex-A76
    "weights": "q8",       # written out: the role's boards run dense Qwen3
}
ROLE_TYPES = {"int": ("int",), "float": ("float", "int"), "bool": ("bool",), "str": ("str", "path")}


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def subcommand(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def base_type(key: str) -> str:
    return FIELDS[key].type.split("|")[0].strip()


def role_options() -> dict:
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text(encoding="utf-8"))
    return specs["argument_specs"]["main"]["options"]


def test_serve_has_one_flag_per_setting_with_its_choices_and_type():
    got = actions(subcommand("serve"))
    for key in KEYS:
        meta = FIELDS[key].metadata
        if not meta["flag"]:
            assert key not in got, f"{key} is file/env only, yet serve has a flag for it"
            continue
        action = got[key]
        assert action.option_strings == [flag_name(key)]
        assert action.default is None, f"{key}: a flag default would hide the settings file"
        assert tuple(action.choices) == meta["choices"] if meta["choices"] else action.choices is None
        if base_type(key) == "bool":
            assert action.nargs == 0
        else:
            assert action.type is {"int": int, "float": float, "str": str}[base_type(key)], key


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_engine_flags_are_the_servers(command):
    serve, other = actions(subcommand("serve")), actions(subcommand(command))
    for key in ENGINE_KEYS:
        a, b = serve[key], other[key]
        assert (a.option_strings, a.choices, a.type, a.help) == (b.option_strings, b.choices, b.type, b.help), key


def test_flags_are_validated_like_every_other_source():
    p = argparse.ArgumentParser()
    add_setting_flags(p, ["kv", "max_batch"])
    with pytest.raises(SystemExit):
        p.parse_args(["--kv", "q3"])          # choices: argparse refuses at once


def test_role_mirrors_the_settings_choices_types_and_defaults():
    options = role_options()
    mirrored = [k for k in KEYS if f"appliance_{k}" in options]
    assert {"weights", "kv", "sparse_k", "sparse_probe_mode", "max_batch", "log_level"} <= set(mirrored)
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text(encoding="utf-8"))
    for key in mirrored:
        spec, meta = options[f"appliance_{key}"], FIELDS[key].metadata
        assert spec["type"] in ROLE_TYPES[base_type(key)], f"appliance_{key}: type {spec['type']}"
        if meta["choices"]:
            assert tuple(spec.get("choices", ())) == meta["choices"], f"appliance_{key}: choices"
        want = BOARD_DEFAULTS.get(key, FIELDS[key].default)
        if spec.get("required") is False and want is None:
            assert "default" not in spec, f"appliance_{key}"
        elif key == "api_key":
            assert spec["default"] == "" and want is None     # empty in Ansible: no key
        else:
            assert spec["default"] == want, f"appliance_{key}: role default {spec['default']!r}, server {want!r}"
        assert defaults.get(f"appliance_{key}") == spec.get("default", None) or (
            spec.get("default") is None and defaults.get(f"appliance_{key}") is None), f"defaults/main.yml: appliance_{key}"


def test_role_settings_template_writes_only_mirrored_keys():
    text = (ROLE / "templates" / "appliance.yml.j2").read_text(encoding="utf-8")
    keys = re.findall(r"^([a-z_]+):", text, flags=re.M)
    options = role_options()
    assert keys and set(keys) <= set(KEYS)
    for key in keys:
        # model: built from appliance_models_dir and the name; board_instances: from appliance_instances
        if key not in ("model", "board_instances"):
            assert f"appliance_{key}" in options, f"the template writes {key} from an undocumented variable"
    assert Settings.__dataclass_fields__.keys() == set(KEYS)
