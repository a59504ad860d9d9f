"""GGUF files for llama.cpp, made by the convert_hf_to_gguf.py that ships inside llama-cpp-python's sdist.

llama.cpp's code is not part of this repository: the sdist of the installed
llama-cpp-python version is downloaded from PyPI once (`pip download --no-deps
--no-binary :all: llama-cpp-python==VERSION`) into the work directory, and only
`vendor/llama.cpp/{convert_hf_to_gguf.py, conversion/, gguf-py/}` are extracted.
The converter runs in a subprocess with the same Python (it needs torch, numpy,
safetensors, transformers, pyyaml, tqdm; its own gguf-py is found next to it).

Q8_0 is written by the converter itself (`--outtype q8_0`). Q4_0 is not one of its
output types: a bf16 GGUF is converted, then quantized by llama.cpp's own
`llama_model_quantize` through llama-cpp-python.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

CONVERTER_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# Modules the converter imports that the project's own requirements may lack (it imports
# sentencepiece even for BPE vocabularies); pip-installed into <workdir>/pydeps if missing.
CONVERTER_DEPS = {"sentencepiece": "sentencepiece>=0.1.98,<0.3.0", "yaml": "pyyaml", "tqdm": "tqdm"}


def llama_cpp_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("llama_cpp_python")
    except Exception:
        return None


def find_or_download_sdist(workdir: Path, sdist: str | os.PathLike | None = None, log=print) -> Path:
    """The llama-cpp-python sdist: the given path, one already in <workdir>/sdist, or a download."""
    if sdist:
        p = Path(sdist)
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such sdist")
        return p
    version = llama_cpp_version()
    d = Path(workdir) / "sdist"
    d.mkdir(parents=True, exist_ok=True)
    pattern = f"llama_cpp_python-{version}.tar.gz" if version else "llama_cpp_python-*.tar.gz"
    found = sorted(d.glob(pattern))
    if found:
        return found[-1]
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    log(f"  downloading the {spec} sdist from PyPI into {d} (once)")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-d", str(d), spec], check=True, stdout=sys.stderr)
    found = sorted(d.glob(pattern))
    if not found:
        raise FileNotFoundError(f"pip download left no {pattern} in {d}")
    return found[-1]


def extract_converter(sdist: Path, workdir: Path) -> Path:
    """Extract convert_hf_to_gguf.py, conversion/ and gguf-py/ once; the llama.cpp directory."""
    name = Path(sdist).name.removesuffix(".tar.gz")
    dest = Path(workdir) / "converter" / name
    root = dest / "vendor" / "llama.cpp"
    done = dest / ".extracted"
    if done.exists():
        return root
    with tarfile.open(sdist) as tar:
        prefix = f"{name}/vendor/llama.cpp/"
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix)
                   and any(m.name[len(prefix):].startswith(x) for x in CONVERTER_MEMBERS)]
        if not any(m.name.endswith("convert_hf_to_gguf.py") for m in members):
            raise FileNotFoundError(f"{sdist} has no {prefix}convert_hf_to_gguf.py")
        for m in members:
            m.name = m.name[len(name) + 1:]
        dest.mkdir(parents=True, exist_ok=True)
        tar.extractall(dest, members=members, filter="data")
    done.write_text("ok\n")
    return root


def converter_pythonpath(workdir: Path, llama_dir: Path, log=print) -> str:
    """PYTHONPATH for the converter: its gguf-py, plus <workdir>/pydeps for missing modules."""
    pydeps = Path(workdir) / "pydeps"
    paths = [str(llama_dir / "gguf-py"), str(pydeps)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    missing = []
    for module, requirement in CONVERTER_DEPS.items():
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True)
        if probe.returncode != 0:
            missing.append(requirement)
    if missing:
        log(f"  installing the converter's missing modules into {pydeps}: {' '.join(missing)}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        "--no-deps", "--target", str(pydeps), *missing], check=True, stdout=sys.stderr)
    return os.pathsep.join(paths)


def gguf_metadata(path: Path, llama_dir: Path, keys: tuple[str, ...]) -> dict:
    """A few string/int metadata fields of a GGUF file, read with the extracted gguf-py."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[2]); import gguf\n"
        "r = gguf.GGUFReader(sys.argv[1]); out = {}\n"
        "for k in sys.argv[3:]:\n"
        "    f = r.fields.get(k)\n"
        "    if f is None: continue\n"
        "    v = f.contents() if hasattr(f, 'contents') else f.parts[f.data[0]].tolist()\n"
        "    out[k] = v if isinstance(v, (str, int, float)) else str(v)\n"
        "types = {}\n"
        "for t in r.tensors: types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1\n"
        "out['tensor_types'] = types\n"
        "print(json.dumps(out))\n")
    import json
    res = subprocess.run([sys.executable, "-c", code, str(path), str(llama_dir / "gguf-py"), *keys],
                         check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def convert(model_dir: Path, out: Path, outtype: str, llama_dir: Path, pythonpath: str, log=print) -> Path:
    """convert_hf_to_gguf.py model_dir --outtype outtype --outfile out (skipped if out exists)."""
    out = Path(out)
    if out.exists():
        return out
    tmp = out.with_name(out.name + ".part")
    logfile = out.with_name(out.name + ".convert.log")
    t0 = time.perf_counter()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(model_dir),
           "--outtype", outtype, "--outfile", str(tmp)]
    with open(logfile, "w") as f:
        res = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        tail = "".join(open(logfile).readlines()[-20:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({res.returncode}); see {logfile}:\n{tail}")
    tmp.rename(out)
    log(f"  {out.name}: converted in {time.perf_counter() - t0:.0f} s (log {logfile.name})")
    return out


def quantize(src: Path, out: Path, ftype_name: str = "LLAMA_FTYPE_MOSTLY_Q4_0", threads: int = 2,
             log=print) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize) through llama-cpp-python, in a subprocess."""
    out = Path(out)
    if out.exists():
        return out
    tmp = out.with_name(out.name + ".part")
    t0 = time.perf_counter()
    code = (
        "import sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        f"p.ftype = llama_cpp.{ftype_name}\n"
        f"p.nthread = {int(threads)}\n"
        "rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)\n"
        "sys.exit(rc)\n")
    res = subprocess.run([sys.executable, "-c", code, str(src), str(tmp)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"llama_model_quantize failed ({res.returncode}): {res.stderr[-2000:]}")
    tmp.rename(out)
    log(f"  {out.name}: quantized in {time.perf_counter() - t0:.0f} s")
    return out


def make_ggufs(model_dir: Path, workdir: Path, q4: bool = False, sdist=None, tag: str = "",
               log=print) -> dict[str, Path]:
    """{"q8_0": path, ["q4_0": path]} for the checkpoint in model_dir, cached in workdir/gguf.

    `tag` names the checkpoint's version in the file names, so a rebuilt checkpoint gets new files.
    """
    sdist_path = find_or_download_sdist(workdir, sdist, log)
    llama_dir = extract_converter(sdist_path, workdir)
    pythonpath = converter_pythonpath(workdir, llama_dir, log)
    gdir = Path(workdir) / "gguf"
    gdir.mkdir(parents=True, exist_ok=True)
    stem = Path(model_dir).name + (f"-{tag}" if tag else "")
    out = {"q8_0": convert(model_dir, gdir / f"{stem}-Q8_0.gguf", "q8_0", llama_dir, pythonpath, log)}
    if q4:
        bf16 = convert(model_dir, gdir / f"{stem}-BF16.gguf", "bf16", llama_dir, pythonpath, log)
        out["q4_0"] = quantize(bf16, gdir / f"{stem}-Q4_0.gguf", log=log)
    out["_llama_dir"] = llama_dir
    return out
