"""Where are the dot-product instructions (sdot/udot, ARMv8.2 dotprod) in an aarch64 build?

    python sdot_report.py BUILD_DIR [--expect-path neon-dotprod|neon|portable|none|any]

Counts them in each object file of the cross build (one per C source: the definitive answer to
"which source holds them"), in the extension, and per function of appliance.kernels._kernels.
Outside kernels/arm/ a dot-product instruction means the compiler auto-vectorised plain C with
sdot (the whole file is built with +dotprod): that code traps (SIGILL) on a CPU without dotprod
although it claims to be portable. It is a WARNING for the kernel sources (portable.c,
sparse_select.c, kv_store.c: only reached once appliance.kernels.dispatch has accepted the CPU).
The report fails (exit 1) when
  * the Cython wrappers (kernels.pyx) or dispatch.c hold one: they run at import and
    hold the runtime feature check itself, which must work on any aarch64 CPU;
  * --expect-path neon-dotprod and appliance.kernels._kernels holds none (the NEON path is not compiled);
  * --expect-path none/neon/portable and the build holds any (a dotprod-less build must not).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

OBJDUMP = "aarch64-linux-gnu-objdump"
DOT = re.compile(r"^\s*[0-9a-f]+:\s+[0-9a-f]{8}\s+([su]dot)\s", re.M)
IMPORT_TIME = {"kernels", "dispatch"}   # objects of kernels.pyx (with its .pxi) and dispatch.c
FUNC = re.compile(r"^[0-9a-f]+ <([^>]+)>:$")


def disassemble(path: Path) -> str:
    return subprocess.run([OBJDUMP, "-d", str(path)],
                          check=True, capture_output=True, text=True).stdout


def count(text: str) -> Counter:
    return Counter(m.group(1) for m in DOT.finditer(text))


def per_function(text: str) -> Counter:
    funcs: Counter = Counter()
    current = "?"
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            current = m.group(1)
        elif DOT.match(line):
            funcs[current] += 1
    return funcs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("build", type=Path)
    ap.add_argument("--expect-path", default="any")
    args = ap.parse_args()
    problems, warnings = [], []

    objects = sorted(args.build.glob("build/temp*/**/*.o"))
    if not objects:
        print(f"sdot report: no object files under {args.build}/build", file=sys.stderr)
        return 1
    print("dot-product instructions (sdot/udot) per object file:")
    for obj in objects:
        rel = obj.relative_to(next(args.build.glob("build/temp*")))
        n = count(disassemble(obj))
        total = sum(n.values())
        print(f"  {str(rel):<40} {total:5d}" + (f"  ({dict(n)})" if total else ""))
        if total and not str(rel).startswith("kernels/arm/"):
            what = (f"{rel} holds {total} dot-product instructions outside kernels/arm/ "
                    "(auto-vectorised plain C: SIGILL on a CPU without dotprod)")
            if obj.stem in IMPORT_TIME:
                problems.append(what + "; it runs at import or is the feature check itself")
            else:
                warnings.append(what)

    totals = {}
    extensions = sorted((args.build / "appliance" / "kernels").glob("_*.cpython-*-aarch64-linux-gnu.so"))
    if not extensions:
        problems.append(f"no aarch64 extension under {args.build}/appliance/kernels")
    for so in extensions:
        text = disassemble(so)
        n = sum(count(text).values())
        totals[so.name.split(".")[0]] = n
        print(f"{so.name}: {n} sdot/udot instructions")
        if so.name.startswith("_kernels"):
            for fn, c in per_function(text).most_common():
                print(f"    {fn:<48} {c:5d}")

    kernels = totals.get("_kernels", 0)
    if args.expect_path == "neon-dotprod" and kernels == 0:
        problems.append("appliance.kernels._kernels holds no sdot: the NEON dotprod kernels are not compiled")
    if args.expect_path in ("none", "neon", "portable") and sum(totals.values()):
        problems.append(f"a build expected without dotprod holds {sum(totals.values())} sdot/udot")
    for w in warnings:
        print(f"sdot report: WARNING: {w}")
    for p in problems:
        print(f"sdot report: FAIL: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
