#!/usr/bin/env python3
"""Regenerate the tables of docs/benchmarks.md from the unedited JSONL files in docs/data/.

Every `umbp-bench ... --json` run prints one JSON object per case and line (docs/benchmarks.md,
"How to read"); the recorded runs are kept as they were printed in docs/data/*.jsonl. A table
in docs/benchmarks.md that is generated sits between two markers:

    <!-- bench-table files="docs/data/lookup-*.jsonl" bench="lookup" case="^match_prefix_64" -->
    ...generated, do not edit...
    <!-- /bench-table -->

Attributes of the opening marker:
  files   a glob relative to the repository root (required); the matching files are read in
          name order (names carry the date), so the newest run is always in the table
  latest  only the last N matching files (the newest run is always one of them)
  bench   only cases of this bench
  case    only cases whose name matches this regular expression
  extra   comma-separated extra fields to show as columns (e.g. "baseline_mt,speedup_mt"); a
          dotted name reads a field of a nested object ("pool_phases_us.first_stage_us")

A file holding several runs (the same case printed again) gets a `run` per repetition. Usage:

    python3 scripts/bench_tables.py            # rewrite docs/benchmarks.md in place
    python3 scripts/bench_tables.py --check    # exit 1 if a table is not what the data says

Python 3 standard library only.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import sys

from bench_jsonl import json_objects

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPEN = re.compile(r"<!-- bench-table (?P<attrs>.*?) -->")
CLOSE = "<!-- /bench-table -->"


def fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v).lower() if isinstance(v, bool) else ""
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v != v:  # NaN
            return "n/a"
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        return f"{v:.3f}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def parse_attrs(text: str) -> dict[str, str]:
    attrs = {}
    for tok in shlex.split(text):
        if "=" not in tok:
            raise SystemExit(f"bench_tables: bad marker attribute {tok!r} (want key=value)")
        k, v = tok.split("=", 1)
        if k not in ("files", "latest", "bench", "case", "extra"):
            raise SystemExit(f"bench_tables: unknown marker attribute {k!r}")
        attrs[k] = v
    if "files" not in attrs:
        raise SystemExit("bench_tables: a bench-table marker needs files=...")
    return attrs


def read_runs(path: str) -> list[dict]:
    """The case lines of one file, each with `_run` (1 + how often its case came before)."""
    out, seen = [], {}

    def bad(msg: str) -> None:
        raise SystemExit(f"bench_tables: {msg}")

    with open(path, encoding="utf-8") as f:
        for rec in json_objects(f, path, bad):
            if "case" not in rec or "value" not in rec:
                continue  # check lines, summaries
            key = (rec.get("bench"), rec["case"])
            seen[key] = seen.get(key, 0) + 1
            rec["_run"] = seen[key]
            out.append(rec)
    return out


def field(r: dict, name: str):
    """`name` of `r`; a dotted name goes into nested objects (None where one is missing)."""
    v = r
    for part in name.split("."):
        v = v.get(part) if isinstance(v, dict) else None
    return v


def table(attrs: dict[str, str]) -> str:
    files = sorted(glob.glob(os.path.join(ROOT, attrs["files"])))
    if not files:
        raise SystemExit(f"bench_tables: no file matches {attrs['files']!r}")
    if "latest" in attrs:
        files = files[-int(attrs["latest"]):]
    case_re = re.compile(attrs.get("case", ""))
    extra = [e for e in attrs.get("extra", "").split(",") if e]
    rows = []
    for path in files:
        for r in read_runs(path):
            if "bench" in attrs and r.get("bench") != attrs["bench"]:
                continue
            if not case_re.search(r["case"]):
                continue
            rows.append((os.path.basename(path), r))
    if not rows:
        raise SystemExit(f"bench_tables: no case matches {attrs} (a table must show data)")
    many_files = len({f for f, _ in rows}) > 1
    many_runs = any(r["_run"] > 1 for _, r in rows)
    head = (["file"] if many_files else []) + (["run"] if many_runs else [])
    head += ["case", "value", "baseline", "speedup"] + extra + ["baseline is"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f, r in rows:
        unit = r.get("unit", "")
        cells = ([f] if many_files else []) + ([str(r["_run"])] if many_runs else [])
        cells += [
            f"`{r['case']}`",
            f"{fmt(r['value'])} {unit}".strip(),
            f"{fmt(r.get('baseline'))} {unit}".strip(),
            f"{fmt(r.get('speedup'))}x",
        ]
        cells += [fmt(field(r, e)) for e in extra]
        cells.append(str(r.get("baseline_name", "")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def regenerate(text: str) -> str:
    out, pos = [], 0
    for m in OPEN.finditer(text):
        if m.start() < pos:
            continue
        end = text.find(CLOSE, m.end())
        if end < 0:
            raise SystemExit(f"bench_tables: marker at offset {m.start()} has no {CLOSE}")
        out.append(text[pos:m.end()])
        out.append("\n" + table(parse_attrs(m.group("attrs"))) + "\n")
        pos = end
    out.append(text[pos:])
    return "".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("doc", nargs="?", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    ap.add_argument("--check", action="store_true", help="exit 1 if the document differs from what the data says")
    a = ap.parse_args()
    with open(a.doc, encoding="utf-8") as f:
        old = f.read()
    new = regenerate(old)
    if a.check:
        if new != old:
            print(f"bench_tables: {a.doc} is out of date (run scripts/bench_tables.py)", file=sys.stderr)
            return 1
        return 0
    if new != old:
        with open(a.doc, "w", encoding="utf-8") as f:
            f.write(new)
    print(f"bench_tables: {a.doc}: {len(OPEN.findall(new))} table(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
