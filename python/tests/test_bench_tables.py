"""scripts/bench_tables.py: the committed benchmark tables are what their raw JSON says, every
area of docs/benchmarks.md opens with its current table, and bad data stops the generator with
a message naming the file and line (no table is made from it)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import bench_tables  # noqa: E402  (a script beside the repository's others, not a package)

CASE = {"bench": "transfer", "case": "kv4k_store_gbps", "value": 51.5, "unit": "GB/s", "baseline": 55.0,
        "baseline_name": "contiguous copy", "speedup": 0.94, "gpu": "NVIDIA H200"}


def marker(data: Path, hardware: str = "one NVIDIA H200", extra: str = "") -> str:
    return (f'<!-- bench-current files="{data}" hardware="{hardware}" command="umbp-bench transfer --json"{extra} -->\n'
            "<!-- /bench-current -->\n")


def write_run(tmp_path: Path, lines: list[str], name: str = "run-2026-12-04.jsonl") -> Path:
    data = tmp_path / name
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return data


@pytest.mark.parametrize("doc", bench_tables.DOCS, ids=lambda p: Path(p).name)
def test_committed_tables_are_what_the_data_says(doc: str) -> None:
    text = Path(doc).read_text(encoding="utf-8")
    assert "<!-- bench-" in text, f"{doc} has no generated table"
    assert bench_tables.regenerate(text, str(Path(doc).parent)) == text, (
        f"{doc} differs from its data: run `python3 scripts/bench_tables.py` and commit the result")


def test_every_area_opens_with_its_current_table() -> None:
    """The current figures are on the first screen of each section: its first lines are the
    generated table, not the history of how it came about."""
    text = Path(bench_tables.DOCS[0]).read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    areas = [s for s in sections if not s.startswith("How to read")]
    assert len(areas) >= 8, [s.splitlines()[0] for s in sections]
    for s in areas:
        head = [line for line in s.splitlines()[1:] if line.strip()][:1]
        assert head and head[0].startswith("<!-- bench-current "), f"section {s.splitlines()[0]!r} does not open with its table"
    assert "history/benchmarks-2026-11.md" in text


def test_a_current_table_names_its_run(tmp_path: Path) -> None:
    data = write_run(tmp_path, [json.dumps(CASE)])
    out = bench_tables.regenerate(marker(data), str(tmp_path))
    assert "| `kv4k_store_gbps` | 51.50 GB/s | 55.00 GB/s | 0.940x | contiguous copy |" in out
    assert f"| 1 | [`{bench_tables.os.path.relpath(data, bench_tables.ROOT)}`](run-2026-12-04.jsonl) | 2026-12-04 | one NVIDIA H200 | `umbp-bench transfer --json` |" in out


def test_a_malformed_json_line_is_refused_with_file_and_line(tmp_path: Path) -> None:
    data = write_run(tmp_path, [json.dumps(CASE), '{"bench":"transfer","case":"kv4k_load_gbps","value":5'])
    with pytest.raises(bench_tables.BenchTableError, match=r"run-2026-12-04\.jsonl:2: not JSON"):
        bench_tables.regenerate(marker(data), str(tmp_path))


def test_a_case_without_a_numeric_value_is_refused(tmp_path: Path) -> None:
    data = write_run(tmp_path, ["a log line, passed over", json.dumps({**CASE, "value": "51.5"})])
    with pytest.raises(bench_tables.BenchTableError, match=r"run-2026-12-04\.jsonl:2: case 'kv4k_store_gbps' has no numeric value"):
        bench_tables.regenerate(marker(data), str(tmp_path))


def test_a_run_credited_to_another_gpu_is_refused(tmp_path: Path) -> None:
    data = write_run(tmp_path, [json.dumps(CASE)])
    with pytest.raises(bench_tables.BenchTableError, match="ran on 'NVIDIA H200', not named in hardware="):
        bench_tables.regenerate(marker(data, hardware="one AMD MI300X"), str(tmp_path))


def test_a_date_that_contradicts_the_file_is_refused(tmp_path: Path) -> None:
    data = write_run(tmp_path, [json.dumps(CASE)])
    with pytest.raises(bench_tables.BenchTableError, match="date=2026-12-05 but .* says 2026-12-04"):
        bench_tables.regenerate(marker(data, extra=' date="2026-12-05"'), str(tmp_path))


def test_check_fails_on_an_edited_table_and_on_bad_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_run(tmp_path, [json.dumps(CASE)])
    doc = tmp_path / "doc.md"
    doc.write_text(bench_tables.regenerate(marker(data), str(tmp_path)), encoding="utf-8")
    assert bench_tables.main(["--check", str(doc)]) == 0

    doc.write_text(doc.read_text(encoding="utf-8").replace("51.50 GB/s", "52.50 GB/s"), encoding="utf-8")
    assert bench_tables.main(["--check", str(doc)]) == 1
    assert "is out of date" in capsys.readouterr().err

    data.write_text(json.dumps(CASE) + "\n{not json\n", encoding="utf-8")
    assert bench_tables.main(["--check", str(doc)]) == 2
    assert "run-2026-12-04.jsonl:2: not JSON" in capsys.readouterr().err
