"""Reading `umbp-bench ... --json` output (docs/benchmarks.md, "How to read"): one JSON object
per measured case and line, mixed with other lines (tables, logs) that are passed over.
Shared by bench_tables.py and plot_benchmarks.py. Python 3 standard library only."""

from __future__ import annotations

import json
from typing import Callable, Iterable, Iterator


def numbered_json_objects(lines: Iterable[str], where: str, bad: Callable[[str], None]) -> Iterator[tuple[int, dict]]:
    """(line number, object) for the JSON objects of `lines` (those that start with "{"). A
    line that is not JSON is handed to `bad` as "<where>:<line number>: not JSON (<error>)":
    raise there to stop, return to pass over it."""
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            bad(f"{where}:{n}: not JSON ({e})")


def json_objects(lines: Iterable[str], where: str, bad: Callable[[str], None]) -> Iterator[dict]:
    """The JSON objects of `lines`, as `numbered_json_objects` without the numbers."""
    for _, obj in numbered_json_objects(lines, where, bad):
        yield obj
