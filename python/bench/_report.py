"""docs/benchmarks.md "How to read" output for the Python benchmarks: one JSON object per case and line with
`--json`, a readable table otherwise (same fields as `umbp-bench`)."""

from __future__ import annotations

import json
import os
import platform
from typing import Any


def _round(v: float) -> float:
    return round(v) if abs(v) >= 100 else round(v, 3)


def case(bench: str, name: str, value: float, unit: str, baseline: float, baseline_name: str,
         lower_is_better: bool = True, **extra: Any) -> dict:
    if lower_is_better:
        speedup = baseline / value if value > 0 else float("nan")
    else:
        speedup = value / baseline if baseline > 0 else float("nan")
    out = {"bench": bench, "case": name, "value": _round(value), "unit": unit,
           "baseline": _round(baseline), "baseline_name": baseline_name,
           "speedup": round(speedup, 2)}
    out.update(extra)
    out.setdefault("cpus", os.cpu_count())
    out.setdefault("python", platform.python_version())
    return out


def emit(cases: list[dict], as_json: bool) -> None:
    if as_json:
        for c in cases:
            print(json.dumps(c), flush=True)
        return
    print(f"{'bench':<16}{'case':<34}{'value':>12} {'unit':<6}{'baseline':>12}  {'speedup':>8}  baseline_name")
    for c in cases:
        print(f"{c['bench']:<16}{c['case']:<34}{c['value']:>12} {c['unit']:<6}{c['baseline']:>12}  "
              f"{c['speedup']:>7}x  {c['baseline_name']}")
