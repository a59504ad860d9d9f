#!/usr/bin/env python3
"""Copies the project's Prometheus rules with every alert's `for:` shortened.

    fast_rules.py SRC_DIR DST_DIR [--for 10s]

The lab cannot wait the production 5-10 minutes for an alert to fire; everything else
(expressions, labels, annotations) stays exactly as in monitoring/prometheus/rules.
"""
import argparse
import os

import yaml


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--for", dest="pending", default="10s")
    a = ap.parse_args()
    os.makedirs(a.dst, exist_ok=True)
    for name in sorted(os.listdir(a.src)):
        if not name.endswith(".yml"):
            continue
        with open(os.path.join(a.src, name), encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        for group in doc.get("groups", []):
            for rule in group.get("rules", []):
                if "alert" in rule and rule.get("for") not in (None, "0m", "0s"):
                    rule["for"] = a.pending
        with open(os.path.join(a.dst, name), "w", encoding="utf-8") as f:
            f.write("# Lab copy of monitoring/prometheus/rules/%s with short `for:` (fast_rules.py)\n" % name)
            yaml.safe_dump(doc, f, sort_keys=False, width=200)


if __name__ == "__main__":
    main()
