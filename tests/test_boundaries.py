"""The rooms of the package stay apart (docs/architecture.md, "Rules of the house").

- The engine side (engine, models, weights, kernels) never imports serving, telemetry or an
  HTTP client: checked on the source of every module, and on a real process that loads an
  engine and generates.
- Serving and telemetry never import the kernels: they meet the engine through its API and
  its plain stats objects.
- The settings (appliance/config.py) load without the engine: a bad flag is reported before
  numpy, the model families or the kernels are imported.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "appliance"
ENGINE_SIDE = ("engine", "models", "weights", "kernels", "options.py", "errors.py")
# Modules the engine side must not reach, directly or through anything it imports.
FORBIDDEN_FOR_ENGINE = ("flask", "werkzeug", "gunicorn", "prometheus_client", "requests", "urllib.request",
                        "http.client", "http.server", "appliance.server", "appliance.telemetry", "appliance.cli")
FORBIDDEN_FOR_SERVING = ("appliance.kernels",)


def imported_names(path: Path) -> set[str]:
    """Every module an import statement of this file names, top-level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def files(*rooms: str) -> list[Path]:
    out = []
    for room in rooms:
        target = PACKAGE / room
        out += sorted(target.rglob("*.py")) if target.is_dir() else [target]
    return out


def violations(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in paths:
        for name in sorted(imported_names(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    return bad


def test_engine_side_sources_import_no_serving_telemetry_or_http():
    assert not violations(files(*ENGINE_SIDE), FORBIDDEN_FOR_ENGINE)


def test_serving_and_telemetry_import_no_kernels():
    assert not violations(files("server", "telemetry"), FORBIDDEN_FOR_SERVING)


def test_the_check_catches_a_violation(tmp_path):
    """The source check is not vacuous: a lazy `import flask` inside a function is found."""
    bad = tmp_path / "leaky.py"
    bad.write_text("def f():\n    from flask import request\n    import urllib.request\n")
    assert imported_names(bad) >= {"flask", "flask.request", "urllib.request"}


LOAD_AND_GENERATE = """
import json, sys
from appliance import Engine
for sparse in (None, {"k": 2}):
    engine = Engine.load(None, max_context=512, sparse=sparse, progress=False)
    prompt = [{"role": "user", "content": "What does json.dumps do?"}]
    text = "".join(e.text for e in engine.generate(prompt, max_tokens=4, temperature=0.7, seed=1))
    long = engine.generate(list(range(3, 300)), stream=False, max_tokens=3, temperature=0)
forbidden = json.loads(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))))
"""


@pytest.mark.parametrize("kernels", ["compiled", "numpy"])
def test_an_engine_process_loads_no_serving_telemetry_or_http(kernels):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(PACKAGE.parent), "OMP_NUM_THREADS": "1"}
    if kernels == "numpy":
        env["APPLIANCE_KERNELS"] = "numpy"
    r = subprocess.run([sys.executable, "-c", LOAD_AND_GENERATE, json.dumps(FORBIDDEN_FOR_ENGINE)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []


def test_settings_load_without_the_engine():
    code = ("import json, sys, appliance.config; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'numpy' "
            "or m == 'appliance.engine' or m.startswith('appliance.engine.'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(PACKAGE.parent)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == []
