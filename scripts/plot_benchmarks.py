#!/usr/bin/env python3
"""Turn `umbp-bench ... --json` output into PNG bar charts for docs/benchmarks.md.

Every `umbp-bench` subcommand prints one JSON object per measured case and line
(docs/benchmarks.md, "How to read"): {"bench", "case", "value", "unit", "baseline", "baseline_name", "speedup", ...}.
This script reads such lines (files or stdin; other lines are ignored), and writes:

  <out>/bench-<bench>.png      per bench: each case's figure beside its baseline, one panel
                               per unit, the speedup written above each pair
  <out>/bench-speedups.png     every case's speedup over its baseline (log scale, 1x marked)

A case given several times (e.g. three runs concatenated) is drawn at its median with a
min-max whisker, and the run count is noted.

    target/release/umbp-bench ring --json  > runs.jsonl
    target/release/umbp-bench index --json >> runs.jsonl
    python3 scripts/plot_benchmarks.py runs.jsonl --out docs/img --note "2-core VM, 2026-11-29"

Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import OrderedDict, defaultdict
from pathlib import Path

from bench_jsonl import json_objects

REQUIRED = ("bench", "case", "value", "unit", "baseline", "baseline_name", "speedup")


def read_cases(paths: list[str]) -> list[dict]:
    """JSON lines with the bench fields, in input order; anything else is skipped."""
    cases = []
    streams = [sys.stdin] if not paths or paths == ["-"] else [open(p, encoding="utf-8") for p in paths]
    for s in streams:
        for obj in json_objects(s, getattr(s, "name", "stdin"), lambda msg: print(f"{msg}: skipped", file=sys.stderr)):
            if all(k in obj for k in REQUIRED):
                cases.append(obj)
    return cases


def aggregate(cases: list[dict]) -> "OrderedDict[tuple[str, str], dict]":
    """(bench, case) -> median value/baseline/speedup, min/max and run count."""
    runs: "OrderedDict[tuple[str, str], list[dict]]" = OrderedDict()
    for c in cases:
        runs.setdefault((c["bench"], c["case"]), []).append(c)
    out: "OrderedDict[tuple[str, str], dict]" = OrderedDict()
    for key, rs in runs.items():
        def num(field: str) -> list[float]:
            return [float(r[field]) for r in rs if isinstance(r.get(field), (int, float)) and math.isfinite(r[field])]

        vals, bases, speeds = num("value"), num("baseline"), num("speedup")
        out[key] = {
            "bench": key[0],
            "case": key[1],
            "unit": rs[-1]["unit"],
            "baseline_name": rs[-1]["baseline_name"],
            "runs": len(rs),
            "value": statistics.median(vals) if vals else float("nan"),
            "value_range": (min(vals), max(vals)) if vals else None,
            "baseline": statistics.median(bases) if bases else float("nan"),
            "baseline_range": (min(bases), max(bases)) if bases else None,
            "speedup": statistics.median(speeds) if speeds else float("nan"),
        }
    return out


def whisker(median: float, rng: tuple[float, float] | None) -> list[list[float]] | None:
    if rng is None or rng[0] == rng[1]:
        return None
    return [[median - rng[0]], [rng[1] - median]]


def needs_log(values: list[float]) -> bool:
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    return len(pos) >= 2 and max(pos) / min(pos) > 50


def plot_bench(plt, bench: str, rows: list[dict], out: Path, note: str) -> Path:
    by_unit: "OrderedDict[str, list[dict]]" = OrderedDict()
    for r in rows:
        by_unit.setdefault(r["unit"], []).append(r)
    fig, axes = plt.subplots(
        1, len(by_unit), figsize=(max(5.0, 2.2 * len(rows) + 1.5 * len(by_unit)), 4.2), squeeze=False
    )
    for ax, (unit, rs) in zip(axes[0], by_unit.items()):
        x = list(range(len(rs)))
        w = 0.38
        vals = [r["value"] for r in rs]
        bases = [r["baseline"] for r in rs]
        for i, r in enumerate(rs):
            ax.bar(i - w / 2, r["value"], w, color="#2b6cb0", yerr=whisker(r["value"], r["value_range"]), capsize=3,
                   label="UMBP" if i == 0 else None)
            ax.bar(i + w / 2, r["baseline"], w, color="#a0aec0", yerr=whisker(r["baseline"], r["baseline_range"]),
                   capsize=3, label="baseline" if i == 0 else None)
        if needs_log(vals + bases):
            ax.set_yscale("log")
        highs = vals + bases + [r[k][1] for r in rs for k in ("value_range", "baseline_range") if r[k]]
        top = max((v for v in highs if math.isfinite(v)), default=1.0)
        for i, r in enumerate(rs):
            if math.isfinite(r["speedup"]):
                y = max([r["value"], r["baseline"]] + [r[k][1] for k in ("value_range", "baseline_range") if r[k]])
                ax.annotate(f'{r["speedup"]:.3g}x', (i, y), textcoords="offset points", xytext=(0, 4),
                            ha="center", fontsize=9, fontweight="bold")
        ax.set_ylim(top=top * (3 if ax.get_yscale() == "log" else 1.18))
        labels = [r["case"] + (f'\n({r["runs"]} runs)' if r["runs"] > 1 else "") for r in rs]
        ax.set_xticks(x, labels, rotation=20 if len(rs) > 3 else 0, ha="right" if len(rs) > 3 else "center", fontsize=8)
        better = "higher" if unit.endswith("/s") or unit.lower() in ("x", "ratio") else "lower"
        ax.set_ylabel(f"{unit} ({better} is better)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    names = sorted({r["baseline_name"] for r in rows})
    fig.suptitle(f"umbp-bench {bench}  (baseline: {'; '.join(names)})", fontsize=10)
    if note:
        fig.text(0.99, 0.01, note, ha="right", va="bottom", fontsize=7, color="#555")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    path = out / f"bench-{bench}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speedups(plt, rows: list[dict], out: Path, note: str) -> Path:
    rows = [r for r in rows if math.isfinite(r["speedup"]) and r["speedup"] > 0]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(rows) + 1.4))
    labels = [f'{r["bench"]}/{r["case"]}' for r in rows]
    speeds = [r["speedup"] for r in rows]
    colors = ["#2f855a" if s >= 1 else "#c53030" for s in speeds]
    y = list(range(len(rows)))
    ax.barh(y, speeds, color=colors)
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for yi, s in zip(y, speeds):
        ax.annotate(f"{s:.3g}x", (s, yi), textcoords="offset points", xytext=(4, 0), va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the baseline measured in the same run (log; > 1 = UMBP better)")
    ax.set_xlim(right=max(speeds) * 4)
    ax.grid(axis="x", alpha=0.3)
    if note:
        fig.text(0.99, 0.01, note, ha="right", va="bottom", fontsize=7, color="#555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = out / "bench-speedups.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="*", help="files of umbp-bench --json lines ('-' or none: stdin)")
    ap.add_argument("--out", default="docs/img", help="directory for the PNGs (default: docs/img)")
    ap.add_argument("--note", default="", help="small text in the corner: machine, date, command")
    ap.add_argument("--bench", action="append", help="only these benches (repeatable)")
    ap.add_argument("--no-summary", action="store_true", help="skip bench-speedups.png")
    a = ap.parse_args(argv)

    cases = read_cases(a.inputs)
    if a.bench:
        cases = [c for c in cases if c["bench"] in a.bench]
    if not cases:
        print("plot_benchmarks: no umbp-bench JSON lines in the input (run umbp-bench with --json)", file=sys.stderr)
        return 1
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_benchmarks: needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(cases)
    per_bench: "defaultdict[str, list[dict]]" = defaultdict(list)
    for r in agg.values():
        per_bench[r["bench"]].append(r)
    for bench, rows in per_bench.items():
        print(plot_bench(plt, bench, rows, out, a.note))
    if not a.no_summary:
        print(plot_speedups(plt, list(agg.values()), out, a.note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
