"""The kernel contract, enforced: one declaration, twins everywhere, one switch, the thread setting.

  * kernels/kernels.h and kernels/kernels.pxd declare the same functions with the same types, and
    the .pxd's extern block is the only one in the kernels' Cython;
  * every _simd kernel has a _portable twin of the same signature, and the build without a SIMD
    path maps every one of them (dispatch.c);
  * every function of the compiled module has a numpy twin of the same signature in
    appliance/kernels/reference.py, and a test calls each kernel's twin;
  * APPLIANCE_KERNELS=numpy imports nothing compiled, sparse decode included;
  * the engine's thread setting reaches every parallel kernel family, the probes included.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KERNELS = REPO / "kernels"
# Functions of the compiled module that say what the build is or set its threads: not kernels.
NOT_KERNELS = {"set_threads", "get_threads", "last_threads", "kernel_path", "cpu_supported", "cpu_features",
               "pool_stats", "pool_hold_workers", "pool_set_spin_us", "pool_stall_workers", "pool_late_workers",
               "gemm_variant", "gemm_variants", "set_gemm_variant", "strips_fast",
               "attention_variant", "attention_variants", "set_attention_variant",
               "attention_q8_weight_bits", "attention_q8_tolerance"}


def _c_type(text: str) -> str:
    return " ".join(text.replace("*", " * ").split()).replace(" *", "*")


def _params(text: str) -> tuple[str, ...]:
    """Parameter types of a C or Cython parameter list, names dropped."""
    params = [p.strip() for p in text.split(",") if p.strip() not in ("", "void")]
    return tuple(_c_type(p.replace("*", " * ").rsplit(None, 1)[0]) for p in params)


def header_functions(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """C name -> (return type, parameter types) of the prototypes in a C header."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"(?m)^\s*#.*$", " ", text)
    found = {}
    for m in re.finditer(r"(?m)^([A-Za-z_][\w ]*?[\s*]+)([A-Za-z_]\w*)\s*\(([^()]*)\)\s*;", text):
        found[m.group(2)] = (_c_type(m.group(1)), _params(m.group(3)))
    return found


def pxd_functions(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """C name -> (return type, parameter types) of the functions a .pxd's extern blocks declare."""
    text = re.sub(r"(?m)#.*$", "", text)
    found = {}
    pattern = r'(?m)^    ([A-Za-z_][\w ]*?[\s*]+)([A-Za-z_]\w*)\s*(?:"(\w+)")?\s*\(([^()]*)\)'
    for m in re.finditer(pattern, text):
        found[m.group(3) or m.group(2)] = (_c_type(m.group(1)), _params(m.group(4)))
    return found


def twin_problems(declared: dict[str, tuple]) -> list[str]:
    problems = []
    for name, signature in declared.items():
        if name.endswith("_simd"):
            twin = name[: -len("_simd")] + "_portable"
            if twin not in declared:
                problems.append(f"{name} has no {twin}")
            elif declared[twin] != signature:
                problems.append(f"{name} and {twin} differ: {signature} vs {declared[twin]}")
    return problems


def cython_sources() -> list[Path]:
    return sorted(p for suffix in ("*.pyx", "*.pxi", "*.pxd") for p in KERNELS.rglob(suffix))


# ---- the declarations -----------------------------------------------------------------------

def test_the_pxd_declares_what_the_header_declares():
    header = header_functions((KERNELS / "kernels.h").read_text())
    pxd = pxd_functions((KERNELS / "kernels.pxd").read_text())
    assert len(header) >= 30 and {"gemm_q8_simd", "attention_probe_portable", "kv_store_q8_simd",
                                  "sparse_select", "kernel_last_threads"} <= set(header)
    assert set(pxd) == set(header), {"only in the header": set(header) - set(pxd),
                                     "only in the pxd": set(pxd) - set(header)}
    for name, signature in header.items():
        assert pxd[name] == signature, (name, signature, pxd[name])


def test_every_simd_kernel_has_a_portable_twin_of_the_same_signature():
    for source in ("kernels.h", "kernels.pxd"):
        text = (KERNELS / source).read_text()
        declared = header_functions(text) if source.endswith(".h") else pxd_functions(text)
        assert sum(name.endswith("_simd") for name in declared) >= 12, source
        assert twin_problems(declared) == [], source


def test_the_twin_check_catches_a_missing_or_different_twin():
    declared = pxd_functions("""cdef extern from "kernels.h" nogil:
    void rmsnorm_portable(const float *x, int64_t M, float *out)
    void rmsnorm_simd(const float *x__md, int64_t M, float *out__md)
    void rope_simd(float *x, int64_t M)
    void silu_portable(const float *g, int64_t n)
    void silu_simd(const float *g, int n)
""")
    assert len(declared) == 5
    assert twin_problems(declared) == ["rope_simd has no rope_portable",
                                       "silu_simd and silu_portable differ: ('void', ('const float*', 'int')) "
                                       "vs ('void', ('const float*', 'int64_t'))"]


def test_a_build_without_simd_maps_every_simd_kernel_to_its_twin():
    text = (KERNELS / "dispatch.c").read_text()
    fallback = text[text.index("#if !defined(KERNELS_HAVE_SIMD)"):text.index("#endif /* !KERNELS_HAVE_SIMD */")]
    mapped = set(re.findall(r"(?m)^void (\w+_simd)\(", fallback))
    simd = {n for n in header_functions((KERNELS / "kernels.h").read_text()) if n.endswith("_simd")}
    assert mapped == simd, {"not mapped": simd - mapped, "not in the contract": mapped - simd}
    for name in simd:
        body = fallback[fallback.index(f"void {name}("):]
        body = body[:body.index("\n}\n")]
        assert name[: -len("_simd")] + "_portable(" in body, name


def test_the_pxd_holds_the_only_extern_block():
    sources = cython_sources()
    assert KERNELS / "kernels.pyx" in sources
    externs = {p.relative_to(REPO).as_posix(): len(re.findall(r"(?m)^\s*cdef\s+extern\b", p.read_text()))
               for p in sources}
    assert {p: n for p, n in externs.items() if n} == {"kernels/kernels.pxd": 1}


# ---- the numpy twin -------------------------------------------------------------------------

def _public_functions(module) -> dict[str, object]:
    return {name: fn for name, fn in vars(module).items()
            if not name.startswith("_") and callable(fn) and not isinstance(fn, type)
            and getattr(fn, "__module__", module.__name__) == module.__name__}


def test_every_compiled_function_has_a_numpy_twin_of_the_same_signature():
    from appliance.kernels import _kernels, reference

    compiled, twins = _public_functions(_kernels), _public_functions(reference)
    assert len(compiled) >= 20
    assert set(compiled) == set(twins), {"no twin": set(compiled) - set(twins),
                                         "twin of nothing": set(twins) - set(compiled)}
    for name, fn in compiled.items():
        assert inspect.signature(fn) == inspect.signature(twins[name]), name


def test_every_kernel_twin_is_used_by_a_test():
    from appliance.kernels import _kernels

    tests = [p.read_text() for p in (REPO / "tests").rglob("*.py") if p != Path(__file__).resolve()]
    kernels = set(_public_functions(_kernels)) - NOT_KERNELS
    unused = {name for name in kernels if not any(re.search(rf"\breference\.{name}\(", t) for t in tests)}
    assert unused == set()


# ---- one switch for every kernel ------------------------------------------------------------

NUMPY_SPARSE_DECODE = """
import json, sys
from appliance.kernels import reference
calls = {}
for name in ("select", "attention_probe_bound", "kv_store"):
    def counted(*args, _name=name, _fn=getattr(reference, name), **kwargs):
        calls[_name] = calls.get(_name, 0) + 1
        return _fn(*args, **kwargs)
    setattr(reference, name, counted)
from appliance import Engine
engine = Engine.load(None, sparse={"k": 2}, progress=False)
engine.generate(list(range(3, 200)), stream=False, max_tokens=3, temperature=0)
compiled = sorted(name for name, m in sys.modules.items()
                  if name.startswith("appliance") and str(getattr(m, "__file__", "")).endswith((".so", ".pyd")))
print(json.dumps({"compiled": compiled, "calls": calls}))
"""


# Under `make test-arm` the tests run in an emulated python, which cannot start another (qemu-user
# has no binfmt_misc here to run an aarch64 executable): the checks below are the same C and
# Python on every path, so the host's run covers them.
in_a_process = pytest.mark.skipif(os.environ.get("APPLIANCE_ARM_EMULATED") == "1",
                                  reason="needs a python subprocess, which the emulated run cannot start")


def _run(script: str, extra_env: dict, *args: str) -> dict:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), **extra_env}
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                       timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


@in_a_process
def test_numpy_kernels_import_nothing_compiled_even_in_sparse_decode():
    """APPLIANCE_KERNELS=numpy: the KV writes, the probe and the block choice run on the twin too."""
    out = _run(NUMPY_SPARSE_DECODE, {"APPLIANCE_KERNELS": "numpy", "OMP_NUM_THREADS": "1"})
    assert out["compiled"] == []
    # 197 prompt tokens in 7 blocks of 32 with k = 2: the sparse prefill chunks and the 3 decode
    # steps probe and choose, on each of the demo model's 4 layers.
    assert out["calls"].get("select", 0) >= 4 * 3 and out["calls"].get("attention_probe_bound", 0) >= 4 * 3
    assert out["calls"].get("kv_store", 0) > 0


@in_a_process
def test_the_compiled_run_of_the_same_script_does_import_the_extension():
    """The check above is not vacuous: without APPLIANCE_KERNELS=numpy it sees the extension."""
    out = _run(NUMPY_SPARSE_DECODE, {"OMP_NUM_THREADS": "1"})
    assert out["compiled"] == ["appliance.kernels._kernels"]
    assert out["calls"] == {}


# ---- the thread setting reaches every parallel kernel ----------------------------------------

THREADS_SPARSE_DECODE = """
import json, sys
from appliance import Engine
from appliance.kernels import _kernels
threads, mode = int(sys.argv[1]), sys.argv[2]
engine = Engine.load(None, threads=threads, sparse={"k": 32, "probe": 32, "probe_mode": mode}, progress=False)
engine.generate(list(range(3, 1200)), stream=False, max_tokens=2, temperature=0)
print(json.dumps(_kernels.last_threads()))
"""


@in_a_process
@pytest.mark.parametrize("mode", ["bound", "strided"])
def test_engine_threads_reach_every_kernel_family(mode):
    """Engine.load(threads=n) (what --threads sets) is the team size every family then runs with.

    The kernels' own default is 2 here (OMP_NUM_THREADS), so a kernel the setting did not reach
    would run 2 threads under threads=1. The context (1197 prompt tokens, 38 blocks > k = 32) makes every family
    parallel once the setting allows it: the GEMM of the 3072-row lm_head, attention at 32 kept
    blocks, the bound probe over its 32 candidates, the strided probe over 38 blocks x 32 rows.
    """
    probe = "probe_bound" if mode == "bound" else "probe"
    for threads in (1, 2):
        ran = _run(THREADS_SPARSE_DECODE, {"OMP_NUM_THREADS": "2"}, str(threads), mode)
        assert {name: ran[name] for name in ("gemm", "attention", probe)} == \
            {"gemm": threads, "attention": threads, probe: threads}, (threads, ran)
