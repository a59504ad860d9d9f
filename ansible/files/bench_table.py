#!/usr/bin/env python3
"""One fleet table from the `appliance bench --json` output of every board.

    bench_table.py RAW_DIR OUT_MD     (RAW_DIR holds <board>.json, one per board)

Each board's JSON is {"exact"|"sparse": {"engine": {...}, "rows": [{context, ...}]}}, plus
"retrieval": [{instance, task, model, inputs, words, per_second}] for a board with embedding
or rerank instances (retrieval_bench.py). Prints the tables and writes them (Markdown) to
OUT_MD, sorted by context (task) then board, so boards alike sit together and an outlier
stands out.
"""
import json
import math
import os
import sys

COLUMNS = [  # (header, row key, format)
    ("decode ms/token", "decode_ms_per_token", "{:.1f}"),
    ("tokens/s", None, "{:.1f}"),
    ("attention share", "attn_share", "{:.0%}"),
    ("prefill tokens/s", "prefill_tokens_per_s", "{:.0f}"),
]


def cell(row: dict, key, fmt: str) -> str:
    if key is None:  # decode tokens/s, from ms/token
        ms = row.get("decode_ms_per_token")
        value = 1000.0 / ms if isinstance(ms, (int, float)) and ms > 0 else None
    else:
        value = row.get(key)
    if not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def table(results: dict) -> str:
    lines = ["| context | board | mode | " + " | ".join(h for h, _, _ in COLUMNS) + " |",
             "|---:|---|---|" + "---:|" * len(COLUMNS)]
    entries = []
    for board, result in results.items():
        for mode, run in sorted(result.items()):
            if mode == "retrieval":
                continue
            for row in run.get("rows", []):
                entries.append((row.get("context", 0), board, mode, row))
    for context, board, mode, row in sorted(entries, key=lambda e: (e[0], e[1], e[2])):
        cells = [cell(row, key, fmt) for _, key, fmt in COLUMNS]
        lines.append(f"| {context} | {board} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def retrieval_table(results: dict) -> str:
    """Embeddings/s and rerank pairs/s per board and instance; empty without such instances."""
    rows = sorted((r["task"], board, r["instance"], r) for board, result in results.items()
                  for r in result.get("retrieval", []))
    if not rows:
        return ""
    lines = ["| task | board | instance | model | per request | embeddings or pairs/s |", "|---|---|---|---|---:|---:|"]
    for task, board, instance, r in rows:
        lines.append(f"| {task} | {board} | {instance} | {r['model']} | {r['inputs']} x {r['words']} words | "
                     f"{r['per_second']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    raw_dir, out = sys.argv[1], sys.argv[2]
    results = {}
    for name in sorted(os.listdir(raw_dir)):
        if name.endswith(".json"):
            with open(os.path.join(raw_dir, name), encoding="utf-8") as f:
                results[name[: -len(".json")]] = json.load(f)
    text = f"# Fleet benchmark: {len(results)} boards\n\n" + table(results)
    retrieval = retrieval_table(results)
    if retrieval:
        text += "\n## Retrieval (embeddings/s for embed, rerank pairs/s for rerank)\n\n" + retrieval
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()
