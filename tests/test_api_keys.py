"""The named API key file (appliance/api_keys.py): both formats, clear errors, and a key ring
that follows the file's rewrites without a restart."""
from __future__ import annotations

import json
import os

import pytest

from appliance.api_keys import SINGLE_KEY_NAME, KeyFileError, KeyRing, parse_keys
from appliance.config import ConfigError, load_settings


def write(path, text: str) -> None:
    """As a rotation writes it: a new file renamed over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_lines_and_json_give_the_same_keys():
    lines = "# clients\nbilling-app  key-billing-0001\n\n  kiosk-2\tkey-kiosk-00002  \n"
    listed = json.dumps([{"name": "billing-app", "key": "key-billing-0001"},
                         {"name": "kiosk-2", "key": "key-kiosk-00002"}])
    mapping = json.dumps({"billing-app": "key-billing-0001", "kiosk-2": "key-kiosk-00002"})
    want = {"billing-app": "key-billing-0001", "kiosk-2": "key-kiosk-00002"}
    assert parse_keys(lines) == parse_keys(listed) == parse_keys(mapping) == want
    assert parse_keys("") == {} and parse_keys("[]") == {}


@pytest.mark.parametrize("text, says", [
    ("app key-app-0001 extra", "line 1: expected 'NAME KEY'"),
    ("app short", "line 1: the key of 'app' must be at least 8"),
    ("a/b key-app-00001", "line 1: name 'a/b'"),
    ("app key-app-0001\napp key-app-0002", "line 2: the name 'app' is given twice"),
    ("one key-same-0001\ntwo key-same-0001", "line 2: 'two' has the same key as 'one'"),
    ('[{"name": "app"}]', "entry 1: expected"),
    ('[{"name": "app", "key": 12345678}]', "entry 1: the key of 'app'"),
    ('[{"name": "app", "key": "key-app-0001"', "not valid JSON"),
])
def test_a_bad_file_is_refused_with_where_and_why(text, says):
    with pytest.raises(KeyFileError, match="api_keys_file") as e:
        parse_keys(text)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_bad_or_missing_file_stops_the_server_at_start(tmp_path):
    with pytest.raises(ConfigError, match=r"api_keys_file: cannot read .*missing"):
        load_settings(overrides={"api_keys_file": str(tmp_path / "missing")})
    bad = tmp_path / "keys"
    bad.write_text("app short\n")
    with pytest.raises(ConfigError, match="line 1: the key of 'app'"):
        load_settings(overrides={"api_keys_file": str(bad)})
    bad.write_text("app long-enough-key\n")
    assert load_settings(overrides={"api_keys_file": str(bad)}).api_keys_file == str(bad)


def test_the_ring_follows_rotations_and_keeps_the_last_good_keys(tmp_path):
    path = tmp_path / "keys"
    write(path, "alpha key-alpha-0001\nbeta key-beta-00001\n")
    ring = KeyRing("single-key-0001", str(path))
    assert ring.required
    assert ring.client("key-alpha-0001") == "alpha" and ring.client("key-beta-00001") == "beta"
    assert ring.client("single-key-0001") == SINGLE_KEY_NAME
    assert ring.client("key-alpha-000") is None and ring.client("") is None
    write(path, "alpha key-alpha-0001\ngamma key-gamma-0001\n")       # beta revoked, gamma added
    assert ring.client("key-beta-00001") is None and ring.client("key-gamma-0001") == "gamma"
    assert ring.client("key-alpha-0001") == "alpha"
    write(path, "alpha short\n")                                      # a broken rewrite: keep the keys
    assert ring.client("key-gamma-0001") == "gamma"
    path.unlink()
    assert ring.client("key-alpha-0001") == "alpha"
    write(path, "delta key-delta-0001\n")                             # back: read again
    assert ring.client("key-delta-0001") == "delta" and ring.client("key-alpha-0001") is None
    assert ring.names() == ["api_key", "delta"]


def test_an_empty_file_still_asks_for_a_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# every client revoked\n")
    ring = KeyRing(None, str(path))
    assert ring.required and ring.client("anything-at-all") is None
    assert not KeyRing(None, None).required
