#!/usr/bin/env python3
"""Regenerate the tables of docs/benchmarks.md (and its history) from the unedited JSONL in docs/data/.

Every `umbp-bench ... --json` run prints one JSON object per case and line (docs/benchmarks.md,
"How to read"); the recorded runs are kept as they were printed in docs/data/. A generated
table sits between two markers, which name where its data is:

    <!-- bench-current files="docs/data/h-gpu13-2026-12-04/*.jsonl" bench="transfer"
         hardware="one NVIDIA H200" command="umbp-bench transfer --backend cuda --json" -->
    ...generated, do not edit...
    <!-- /bench-current -->

    <!-- bench-table files="docs/data/lookup-*.jsonl" bench="lookup" case="^match_prefix_64" -->
    ...generated, do not edit...
    <!-- /bench-table -->

`bench-current` is an area's current table: figure, value, same-run baseline, ratio, what the
baseline is, then one line per run it draws on with the raw JSON file, the date (from the
file's path), the hardware and the command. `bench-table` (the history's tables) lists the
cases of the matching files.

Attributes of the opening marker:
  files     a glob relative to the repository root (required); the matching files are read in
            name order (names carry the date). bench-current: several sources separated by ";"
  latest    only the last N matching files (the newest run is always one of them)
  bench     only cases of this bench
  case      only cases whose name matches this regular expression
  run       only these repetitions (comma-separated, 1 = the first line of a case in a file)
            (bench-current: bench, case and run may be given per source, separated by ";")
  extra     comma-separated extra fields to show as columns (e.g. "baseline_mt,speedup_mt"); a
            dotted name reads a field of a nested object ("pool_phases_us.first_stage_us")
  hardware  bench-current, required: the machine, one per source (";") or one for all. A
            source whose lines name a `gpu` must name that GPU here
  command   bench-current, required: the command that printed the lines, as for hardware
  date      bench-current: the date, where a file's path carries none (YYYY-MM-DD)

A file holding several runs (the same case printed again) gets a `run` per repetition. A line
that is not JSON, or a measured case (a line with `bench` and `case`) without a numeric `value`,
stops the generator with the file and line. Usage:

    python3 scripts/bench_tables.py            # rewrite docs/benchmarks.md and the history in place
    python3 scripts/bench_tables.py --check    # exit 1 if a table is not what the data says
    python3 scripts/bench_tables.py DOC...     # only these documents

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_jsonl import numbered_json_objects  # noqa: E402  (a sibling script, not a package)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "docs", "benchmarks.md"), os.path.join(ROOT, "docs", "history", "benchmarks-2026-11.md")]
OPEN = re.compile(r"<!-- (?P<kind>bench-table|bench-current) (?P<attrs>.*?) -->", re.S)
ATTRS = {
    "bench-table": {"files", "latest", "bench", "case", "run", "extra"},
    "bench-current": {"files", "latest", "bench", "case", "run", "extra", "hardware", "command", "date"},
}
DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")


class BenchTableError(Exception):
    """The data or a marker is not what a table can be made from; the message says where."""


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


def parse_attrs(kind: str, text: str) -> dict[str, str]:
    attrs = {}
    for tok in shlex.split(text):
        if "=" not in tok:
            raise BenchTableError(f"bad marker attribute {tok!r} (want key=value)")
        k, v = tok.split("=", 1)
        if k not in ATTRS[kind]:
            raise BenchTableError(f"unknown {kind} attribute {k!r}")
        attrs[k] = v
    if "files" not in attrs:
        raise BenchTableError(f"a {kind} marker needs files=...")
    if kind == "bench-current":
        for k in ("hardware", "command"):
            if k not in attrs:
                raise BenchTableError(f"a bench-current marker needs {k}=... (files={attrs['files']!r})")
    return attrs


def read_runs(path: str) -> list[dict]:
    """The case lines of one file, each with `_run` (1 + how often its case came before)."""
    out, seen = [], {}
    rel = os.path.relpath(path, ROOT)

    def bad(msg: str) -> None:
        raise BenchTableError(msg)

    with open(path, encoding="utf-8") as f:
        for n, rec in numbered_json_objects(f, rel, bad):
            if "case" not in rec or "bench" not in rec:
                continue  # check lines, summaries: a measured case names its bench
            if isinstance(rec.get("value"), bool) or not isinstance(rec.get("value"), (int, float)):
                raise BenchTableError(f"{rel}:{n}: case {rec['case']!r} has no numeric value ({rec.get('value')!r})")
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


def matching_files(pattern: str, latest: str | None) -> list[str]:
    files = sorted(glob.glob(os.path.join(ROOT, pattern)))
    if not files:
        raise BenchTableError(f"no file matches {pattern!r}")
    if latest:
        files = files[-int(latest):]
    return files


def select(files: list[str], attrs: dict[str, str]) -> list[tuple[str, dict]]:
    """(file, case line) of `files` that the marker's bench, case and run filters keep."""
    case_re = re.compile(attrs.get("case", ""))
    runs = {int(x) for x in attrs.get("run", "").split(",") if x}
    rows = []
    for path in files:
        for r in read_runs(path):
            if "bench" in attrs and r.get("bench") != attrs["bench"]:
                continue
            if not case_re.search(r["case"]):
                continue
            if runs and r["_run"] not in runs:
                continue
            rows.append((path, r))
    return rows


def figure_cells(r: dict, extra: list[str], no_ratio: str = "x") -> list[str]:
    """Case, value, baseline, ratio and `extra` of case line `r`; `no_ratio` where the line has
    no speedup (a bound of zero: nothing to divide by)."""
    unit = r.get("unit", "")
    ratio = r.get("speedup")
    cells = [
        f"`{r['case']}`",
        f"{fmt(r['value'])} {unit}".strip(),
        f"{fmt(r.get('baseline'))} {unit}".strip(),
        no_ratio if ratio is None else f"{fmt(ratio)}x",
    ]
    cells += [fmt(field(r, e)) for e in extra]
    return cells


def history_table(attrs: dict[str, str]) -> str:
    files = matching_files(attrs["files"], attrs.get("latest"))
    extra = [e for e in attrs.get("extra", "").split(",") if e]
    rows = select(files, attrs)
    if not rows:
        raise BenchTableError(f"no case matches {attrs} (a table must show data)")
    many_files = len({f for f, _ in rows}) > 1
    many_runs = any(r["_run"] > 1 for _, r in rows)
    head = (["file"] if many_files else []) + (["run"] if many_runs else [])
    head += ["case", "value", "baseline", "speedup"] + extra + ["baseline is"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f, r in rows:
        cells = ([os.path.basename(f)] if many_files else []) + ([str(r["_run"])] if many_runs else [])
        cells += figure_cells(r, extra) + [str(r.get("baseline_name", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def per_source(attrs: dict[str, str], key: str, n: int) -> list[str]:
    """Attribute `key` split per source: one value for each of the `n` sources, or one for all."""
    vals = [v.strip() for v in attrs[key].split(";")] if key in attrs else []
    if len(vals) == 1:
        return vals * n
    if len(vals) != n:
        raise BenchTableError(f"{key}= gives {len(vals)} values for {n} sources (files={attrs['files']!r})")
    return vals


def file_date(path: str, given: str | None) -> str:
    m = DATE.search(os.path.relpath(path, ROOT))
    if m:
        if given and given != m.group(1):
            raise BenchTableError(f"date={given} but {os.path.relpath(path, ROOT)} says {m.group(1)}")
        return m.group(1)
    if given:
        return given
    raise BenchTableError(f"{os.path.relpath(path, ROOT)}: no date in its path; give date=YYYY-MM-DD")


def check_hardware(path: str, rows: list[dict], hardware: str) -> None:
    """Lines that name their GPU or date must agree with the marker (a table cannot credit a run
    to the wrong machine or day)."""
    for r in rows:
        gpu = r.get("gpu")
        if isinstance(gpu, str) and gpu not in hardware:
            raise BenchTableError(f"{os.path.relpath(path, ROOT)}: case {r['case']!r} ran on {gpu!r}, not named in hardware={hardware!r}")


def current_table(attrs: dict[str, str], doc_dir: str) -> str:
    patterns = [p.strip() for p in attrs["files"].split(";")]
    hardware = per_source(attrs, "hardware", len(patterns))
    command = per_source(attrs, "command", len(patterns))
    n = len(patterns)
    dates = per_source(attrs, "date", n) if "date" in attrs else [None] * n
    # bench, case and run may differ per source too; an empty value keeps every case
    filters = [{k: v for k, v in zip(("bench", "case", "run"), vals) if v} for vals in zip(
        *(per_source(attrs, k, n) if k in attrs else [""] * n for k in ("bench", "case", "run")))]
    extra = [e for e in attrs.get("extra", "").split(",") if e]
    sources = []  # (file, hardware, command, date)
    rows = []  # (source number, case line)
    for pattern, hw, cmd, given, flt in zip(patterns, hardware, command, dates, filters):
        for path in matching_files(pattern, attrs.get("latest")):
            picked = select([path], flt)
            if not picked:
                continue
            check_hardware(path, [r for _, r in picked], hw)
            sources.append((path, hw, cmd, file_date(path, given)))
            rows += [(len(sources), r) for _, r in picked]
    if not rows:
        raise BenchTableError(f"no case matches {attrs} (a table must show data)")
    many_sources = len(sources) > 1
    many_runs = any(r["_run"] > 1 for _, r in rows)
    head = (["source"] if many_sources else []) + (["run"] if many_runs else [])
    head += ["figure", "value", "same-run baseline", "ratio"] + extra + ["baseline is"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s, r in rows:
        cells = ([str(s)] if many_sources else []) + ([str(r["_run"])] if many_runs else [])
        cells += figure_cells(r, extra, no_ratio="n/a") + [str(r.get("baseline_name", ""))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| source | raw JSON | date | hardware | command |", "|---|---|---|---|---|"]
    for n, (path, hw, cmd, date) in enumerate(sources, 1):
        rel = os.path.relpath(path, ROOT)
        link = os.path.relpath(path, doc_dir)
        lines.append(f"| {n} | [`{rel}`]({link}) | {date} | {hw} | `{cmd}` |")
    return "\n".join(lines)


def regenerate(text: str, doc_dir: str = os.path.join(ROOT, "docs")) -> str:
    """`text` with every marked table made afresh from its data; `doc_dir` is where the
    document lives (its links to the raw files are relative to it)."""
    out, pos = [], 0
    for m in OPEN.finditer(text):
        if m.start() < pos:
            continue
        close = f"<!-- /{m.group('kind')} -->"
        end = text.find(close, m.end())
        if end < 0:
            raise BenchTableError(f"{m.group('kind')} marker at offset {m.start()} has no {close}")
        attrs = parse_attrs(m.group("kind"), m.group("attrs").replace("\n", " "))
        out.append(text[pos:m.end()])
        table = current_table(attrs, doc_dir) if m.group("kind") == "bench-current" else history_table(attrs)
        out.append("\n" + table + "\n")
        pos = end
    out.append(text[pos:])
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("docs", nargs="*", default=DOCS, help="documents to regenerate (default: docs/benchmarks.md and its history)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a document differs from what the data says")
    a = ap.parse_args(argv)
    stale = 0
    for doc in a.docs:
        with open(doc, encoding="utf-8") as f:
            old = f.read()
        try:
            new = regenerate(old, os.path.dirname(os.path.abspath(doc)))
        except BenchTableError as e:
            print(f"bench_tables: {doc}: {e}", file=sys.stderr)
            return 2
        if a.check:
            if new != old:
                print(f"bench_tables: {doc} is out of date (run scripts/bench_tables.py)", file=sys.stderr)
                stale += 1
            continue
        if new != old:
            with open(doc, "w", encoding="utf-8") as f:
                f.write(new)
        print(f"bench_tables: {doc}: {len(OPEN.findall(new))} table(s)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
