"""The pool's settings table from Python: `umbp._native.pool_settings()` is the table
umbp-pool's flags are built from; `umbp.vllm.config` takes the pool's defaults from it, an
`EmbeddedPool` keyword left out (None) is the table's default, and a bad value raises
ValueError naming the keyword."""

from __future__ import annotations

import json

import pytest

from umbp.vllm.config import SsdOptions, UMBPConnectorConfig

MiB = 1 << 20
EMBEDDED_POOL_KEYWORDS = (
    "capacity_bytes", "socket_path", "high_wm", "low_wm", "min_object_bytes", "hugepages", "numa_node",
    "prefault", "copy_threads", "ssd_dir", "ssd_capacity", "ssd_high_wm", "ssd_low_wm", "ssd_direct_io",
    "ssd_admission", "ssd_segment_bytes", "ssd_flush_on_stop",
)


def table(native):
    return {s["name"]: s for s in native.pool_settings()}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in ("UMBP_SSD_ENABLED", "UMBP_SSD_DIR", "UMBP_SSD_CAPACITY", "UMBP_SSD_DIRECT_IO",
              "UMBP_SSD_HIGH_WM", "UMBP_SSD_LOW_WM", "UMBP_SSD_ADMISSION", "UMBP_DRAM_CAPACITY"):
        monkeypatch.delenv(k, raising=False)


def test_every_embedded_pool_keyword_is_a_row(native):
    rows = native.pool_settings()
    t = table(native)
    assert len(t) == len(rows), "names are unique"
    for k in EMBEDDED_POOL_KEYWORDS:
        assert k in t, k
    for s in rows:
        assert set(s) == {"name", "kind", "default", "env", "flag", "help"}, s
        assert s["help"] and (s["env"] is None or s["env"].startswith("UMBP_")), s
    assert (t["ssd_dir"]["flag"], t["ssd_dir"]["env"]) == ("ssd-dir", "UMBP_SSD_DIR")
    assert (t["high_wm"]["flag"], t["high_wm"]["env"]) == ("high-wm", "UMBP_DRAM_HIGH_WM")


def test_config_defaults_are_the_tables(native, tmp_path):
    t = table(native)
    hi, lo = float(t["high_wm"]["default"]), float(t["low_wm"]["default"])
    assert (UMBPConnectorConfig().dram_high_watermark, UMBPConnectorConfig().dram_low_watermark) == (hi, lo)
    c = UMBPConnectorConfig.from_extra_config({"ssd_dir": str(tmp_path)})
    assert (c.dram_high_watermark, c.dram_low_watermark) == (hi, lo)
    ssd_hi, ssd_lo = float(t["ssd_high_wm"]["default"]), float(t["ssd_low_wm"]["default"])
    direct = t["ssd_direct_io"]["default"] == "true"
    assert (c.ssd.high_watermark, c.ssd.low_watermark, c.ssd.direct_io) == (ssd_hi, ssd_lo, direct)
    s = SsdOptions(dirs=(str(tmp_path),))
    assert (s.high_watermark, s.low_watermark, s.direct_io) == (ssd_hi, ssd_lo, direct)


def test_keywords_left_out_take_the_table_defaults(native, short_tmp, tmp_path):
    t = table(native)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    pool = native.EmbeddedPool(8 * MiB, socket_path=str(short_tmp / "a.sock"), ssd_dir=[str(a)], ssd_capacity=64 * MiB)
    try:
        r = json.loads(pool.report())
        assert (r["pool"]["high_watermark"], r["pool"]["low_watermark"]) == (
            float(t["high_wm"]["default"]), float(t["low_wm"]["default"]))
        assert r["ssd"]["high_watermark"] == float(t["ssd_high_wm"]["default"])
        assert r["ssd"]["capacity_bytes"] == 64 * MiB
    finally:
        pool.close()
    # No capacity: the pool's one rule (half the free space, at least a segment), as umbp-pool.
    pool = native.EmbeddedPool(8 * MiB, socket_path=str(short_tmp / "b.sock"), ssd_dir=[str(b)])
    try:
        assert json.loads(pool.report())["ssd"]["capacity_bytes"] >= MiB
    finally:
        pool.close()


def test_a_bad_value_names_the_keyword(native, short_tmp, tmp_path):
    cases = [
        ({"capacity_bytes": 1024}, "capacity_bytes"),
        ({"high_wm": 0.5, "low_wm": 0.6}, "low_wm"),
        ({"high_wm": 1.5}, "high_wm"),
        ({"min_object_bytes": 0}, "min_object_bytes"),
        ({"ssd_dir": [str(tmp_path / "missing")]}, "ssd_dir"),
        ({"ssd_dir": [str(tmp_path)], "ssd_high_wm": 0.5, "ssd_low_wm": 0.8}, "ssd_low_wm"),
        ({"ssd_dir": [str(tmp_path)], "ssd_capacity": 512 << 10}, "ssd_capacity"),
    ]
    for kwargs, key in cases:
        kwargs = {"capacity_bytes": 8 * MiB, "socket_path": str(short_tmp / "p.sock"), **kwargs}
        with pytest.raises(ValueError) as ei:
            native.EmbeddedPool(**kwargs).close()
        assert str(ei.value).startswith(f"{key}: "), (kwargs, str(ei.value))
