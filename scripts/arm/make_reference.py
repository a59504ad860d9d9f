"""Host side of `make test-arm`: a tiny random Qwen3 and the logits the emulated engine must reproduce.

    python scripts/arm/make_reference.py --out DIR

Writes DIR/model/ (a Hugging Face checkpoint + tokenizer, built by tests/tiny_models.py) and
DIR/reference.npz with, for one token sequence `ids`:
  transformers_f32   float32[T, V]  transformers' logits (torch, on the host)
  twin_<w>_<kv>      float32[T, V]  the engine's logits with weights <w> and KV <kv>, computed with
                                    the kernels' numpy twin (APPLIANCE_KERNELS=numpy): the definition
                                    the compiled kernels are held to
Under emulation tests/arm/test_arm_model.py runs the engine on the compiled aarch64 kernels over
the same ids and compares (torch is never needed there). Cached: nothing is rebuilt while this
script, tests/tiny_models.py, the appliance package and the torch/transformers/numpy versions
stay the same.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

# The reference is the numpy twin, not whatever this host's compiled kernels are (set before
# anything imports appliance.kernels.dispatch).
os.environ["APPLIANCE_KERNELS"] = "numpy"
os.environ.setdefault("OMP_NUM_THREADS", "2")

REPO = Path(__file__).resolve().parents[2]

# Small enough for seconds under emulation; K and head_dim multiples of 32 so that every
# quantized format and both GEMM (prefill) and GEMV (decode) paths are exercised.
SHAPE = dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=64, seed=11)
TEXT = ("Edge boards run language models on their CPUs with int8 kernels. "
        "The quick brown fox jumps over the lazy dog. Hello world! How are you today?") * 2
MODES = [("f32", "f32"), ("q8", "q8"), ("q4", "q8"), ("q8", "q4"), ("q8", "f32")]


def cache_key(repo: Path) -> str:
    import numpy
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    files = [repo / "tests" / "tiny_models.py"] + sorted((repo / "appliance").rglob("*.py"))
    for f in files:
        h.update(str(f.relative_to(repo)).encode())
        h.update(f.read_bytes())
    h.update(repr((SHAPE, TEXT, MODES, numpy.__version__, torch.__version__,
                   transformers.__version__)).encode())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repo", type=Path, default=REPO, help="source tree whose appliance package runs")
    args = ap.parse_args()
    out: Path = args.out
    repo: Path = args.repo.resolve()
    sys.path[:0] = [str(repo), str(repo / "tests")]
    try:
        key = cache_key(repo)
    except ImportError as e:
        print(f"make_reference: FAIL: the host Python needs torch and transformers ({e}); "
              "run `make setup`", file=sys.stderr)
        return 1
    stamp = out / "key"
    if stamp.is_file() and stamp.read_text() == key and (out / "reference.npz").is_file():
        print(f"reference: cached ({out / 'reference.npz'})")
        return 0

    import numpy as np

    from appliance import Engine
    from tiny_models import build_qwen3, reference_logits

    t0 = time.time()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model_dir = build_qwen3(out / "model", **SHAPE)
    arrays = {}
    ids = None
    for weights, kv in MODES:
        engine = Engine.load(model_dir, weights=weights, kv=kv, progress=False)
        if ids is None:
            ids = engine.tokenizer.encode(TEXT)
        arrays[f"twin_{weights}_{kv}"] = engine.logits(ids).astype(np.float32)
    arrays["transformers_f32"] = reference_logits(model_dir, ids).astype(np.float32)
    arrays["ids"] = np.asarray(ids, np.int32)
    np.savez(out / "reference.npz", **arrays)
    # The engine caches quantized weights next to the checkpoint; the emulated run makes its own.
    shutil.rmtree(model_dir / ".appliance-cache", ignore_errors=True)
    stamp.write_text(key)
    print(f"reference: {len(ids)} tokens, modes {', '.join(f'{w}/{k}' for w, k in MODES)} "
          f"-> {out / 'reference.npz'} ({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
