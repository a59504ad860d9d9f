"""Settings: defaults < YAML file < APPLIANCE_* env < flags, validated with one-line errors."""
from __future__ import annotations

import argparse

import pytest

from appliance.config import ConfigError, Settings, load_settings


def test_defaults():
    s = load_settings(environ={})
    assert s == Settings()
    assert (s.host, s.port, s.weights, s.kv, s.model) == ("127.0.0.1", 8080, None, "q8", None)
    assert s.http_threads == s.max_batch + s.max_queue + 8


def test_precedence_file_env_flags(tmp_path):
    f = tmp_path / "appliance.yml"
    f.write_text("port: 9000\nmax_batch: 2\nweights: q4\nsparse_attn: true\nhost: 0.0.0.0\n")
    env = {"APPLIANCE_PORT": "9100", "APPLIANCE_MAX_BATCH": "3", "APPLIANCE_UNRELATED": "x"}
    s = load_settings(str(f), env, {"port": 9200, "host": None})
    assert s.port == 9200            # flag beats env beats file
    assert s.max_batch == 3          # env beats file
    assert s.weights == "q4" and s.sparse_attn is True and s.host == "0.0.0.0"   # file beats defaults
    assert s.sparse_config() == {"k": 32, "block": 32, "probe": 8, "probe_mode": "bound"}


def test_config_file_from_env(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max_queue: 5\n")
    assert load_settings(environ={"APPLIANCE_CONFIG": str(f)}).max_queue == 5


def test_env_types(tmp_path):
    env = {"APPLIANCE_SPARSE_ATTN": "yes", "APPLIANCE_REQUEST_TIMEOUT": "2.5", "APPLIANCE_THREADS": "none",
           "APPLIANCE_API_KEY": "sekrit-key", "APPLIANCE_SYSFS_ROOT": str(tmp_path), "APPLIANCE_MODEL": str(tmp_path)}
    s = load_settings(environ=env)
    assert s.sparse_attn is True and s.request_timeout == 2.5 and s.threads is None
    assert s.api_key == "sekrit-key" and s.public()["api_key"] == "set"
    assert s.sysfs_root == str(tmp_path) and s.model == str(tmp_path)


@pytest.mark.parametrize("source, message", [
    ({"APPLIANCE_PORT": "eighty"}, "port (environment): expected an integer, got 'eighty'"),
    ({"APPLIANCE_PORT": "70000"}, "port: 70000 is outside 1..65535"),
    ({"APPLIANCE_WEIGHTS": "q3"}, "weights: 'q3' is not one of q8, q4, f32"),
    ({"APPLIANCE_KV": "fp8"}, "kv: 'fp8' is not one of q8, q4, f32"),
    ({"APPLIANCE_MAX_BATCH": "0"}, "max_batch: 0 is outside 1..256"),
    ({"APPLIANCE_MAX_QUEUE": "-1"}, "max_queue: -1 is outside 0..4096"),
    ({"APPLIANCE_SPARSE_ATTN": "maybe"}, "sparse_attn (environment): expected true or false, got 'maybe'"),
    ({"APPLIANCE_REQUEST_TIMEOUT": "0"}, "request_timeout: 0.0 must be positive (seconds)"),
    ({"APPLIANCE_API_KEY": "short"}, "api_key: use at least 8 characters"),
    ({"APPLIANCE_MAX_BODY_BYTES": "12"}, "max_body_bytes: 12 is below 1024"),
])
def test_env_errors_are_one_line(source, message):
    with pytest.raises(ConfigError) as e:
        load_settings(environ=source)
    assert str(e.value) == message and "\n" not in str(e.value)


@pytest.mark.parametrize("text, fragment", [
    ("port: [1, 2]\n", "port (config"),
    ("colour: blue\n", "unknown key 'colour'"),
    ("- a\n- b\n", "expected a mapping of settings"),
    ("port: 80\n  bad: indent\n", "invalid YAML at line"),
    ("max_batch: true\n", "max_batch (config"),
])
def test_file_errors(tmp_path, text, fragment):
    f = tmp_path / "bad.yml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(str(f), {})
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(str(tmp_path / "absent.yml"), {})


def test_empty_file_is_defaults(tmp_path):
    f = tmp_path / "empty.yml"
    f.write_text("# nothing\n")
    assert load_settings(str(f), {}) == Settings()


def test_serve_flags_map_to_settings(tmp_path):
    from appliance.server.gunicorn import add_serve_arguments, gunicorn_options, settings_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(["--port", "8123", "--max-batch", "3", "--max-queue", "2", "--sparse-attn",
                         "--kv", "q4", "--api-key", "0123456789"])
    s = settings_from_args(args, environ={"APPLIANCE_PORT": "9999", "APPLIANCE_HOST": "127.0.0.2"})
    assert (s.port, s.host, s.max_batch, s.max_queue, s.kv, s.sparse_attn) == (8123, "127.0.0.2", 3, 2, "q4", True)
    opts = gunicorn_options(s, control_socket=str(tmp_path / "ctl"))
    assert opts["workers"] == 1 and opts["worker_class"] == "gthread"
    assert opts["threads"] == 3 + 2 + 8 and opts["bind"] == ["127.0.0.2:8123"]
    assert opts.get("control_socket", str(tmp_path / "ctl")) == str(tmp_path / "ctl")
    assert opts["preload_app"] is False


def test_serve_reports_bad_settings(capsys):
    from appliance.cli import main

    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "appliance serve: port: 0 is outside 1..65535"


def test_default_body_limit_admits_the_largest_image_as_a_data_url():
    """A camera photo up to images.MAX_IMAGE_BYTES must not hit 413 before the image checks."""
    from appliance.models.images import MAX_IMAGE_BYTES
    data_url = len("data:image/jpeg;base64,") + 4 * -(-MAX_IMAGE_BYTES // 3)
    assert Settings().max_body_bytes >= data_url + 4096          # plus the JSON around it


def test_a_missing_model_directory_is_not_a_settings_error(tmp_path):
    """The server starts and reports it (/health), so the settings load; the problem is named."""
    from appliance.config import model_dir_problem
    s = load_settings(environ={"APPLIANCE_MODEL": "/nonexistent/model"})
    assert model_dir_problem(s) == "model: '/nonexistent/model' is not a directory"
    assert model_dir_problem(load_settings(environ={"APPLIANCE_MODEL": str(tmp_path)})) is None
    assert model_dir_problem(load_settings(environ={})) is None


@pytest.mark.parametrize("value, message", [
    ("[1]", "board_instances[0]: expected {name, port, task, model}, got 1"),
    ('[{"name": "chat", "port": 0}]', "board_instances[0].port: expected a port number 1..65535, got 0"),
    ('[{"name": "e", "port": 8081, "task": "draw"}]', "board_instances[0].task: 'draw' is not one of chat, embed, rerank"),
    ('{"name": "e"}', "board_instances: expected a JSON list, got '{\"name\": \"e\"}'"),
])
def test_board_instances_errors_name_the_entry(value, message):
    with pytest.raises(ConfigError) as e:
        load_settings(environ={"APPLIANCE_BOARD_INSTANCES": value})
    assert str(e.value) == message


def test_board_instances_from_a_yaml_list(tmp_path):
    from appliance.config import board_instances
    f = tmp_path / "s.yml"
    f.write_text("port: 8081\nboard_instances:\n  - {name: chat, port: 8080, task: chat, model: q}\n"
                 "  - {name: embed, port: 8081, task: embed}\n")
    assert board_instances(load_settings(str(f), {})) == [
        {"name": "chat", "port": 8080, "task": "chat", "model": "q"},
        {"name": "embed", "port": 8081, "task": "embed", "model": None}]
