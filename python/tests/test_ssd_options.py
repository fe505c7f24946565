"""The SSD tier from Python (issue #16): the connector's ssd_* options and the seed's
UMBP_SSD_* environment, each parsed and its effect observed; the binding's EmbeddedPool
with an SSD directory keeping several times its DRAM loadable byte-exact; bad directories
refused naming the option and the path; KV events carrying the tier.

Parsing reads the pool's defaults and the pool tests need `umbp._native` (conftest `native`)."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import time

import pytest

from umbp.vllm import config as C
from umbp.vllm.config import SsdOptions, UMBPConnectorConfig
from umbp.vllm.tier_events import last_per_key, medium_of, slowest_tier

MiB = 1 << 20
PAGE = 64 << 10  # one object = one 64 KiB page (the pool's default min object size)
SSD_ENV = ("UMBP_SSD_ENABLED", "UMBP_SSD_DIR", "UMBP_SSD_CAPACITY", "UMBP_SSD_DIRECT_IO",
           "UMBP_SSD_HIGH_WM", "UMBP_SSD_LOW_WM", "UMBP_SSD_ADMISSION")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in SSD_ENV + (C.ENV_STANDALONE_ADDRESS, C.ENV_DRAM_CAPACITY):
        monkeypatch.delenv(k, raising=False)


def parse(extra):
    return UMBPConnectorConfig.from_extra_config(extra)


def fails(extra, *words):
    with pytest.raises(ValueError) as ei:
        parse(extra)
    for w in words:
        assert w in str(ei.value), f"{w!r} not in: {ei.value}"
    return str(ei.value)


# -- parsing ------------------------------------------------------------------------------


def test_no_ssd_by_default_and_pool_kwargs_unchanged():
    c = parse({})
    assert c.ssd is None
    assert c.embedded_pool_kwargs() == {"high_wm": 0.9, "low_wm": 0.7}


def test_keys_reach_the_pool_kwargs_with_a_directory_per_rank(tmp_path):
    a, b = tmp_path / "nvme0", tmp_path / "nvme1"
    a.mkdir()
    b.mkdir()
    c = parse({"ssd_dir": [str(a), str(b)], "ssd_capacity": "2GiB", "ssd_high_watermark": 0.9,
               "ssd_low_watermark": "0.5", "ssd_direct_io": "false", "ssd_admission": "hit-or-young:5"})
    assert c.ssd == SsdOptions(dirs=(str(a), str(b)), capacity_bytes=2 << 30, high_watermark=0.9,
                               low_watermark=0.5, direct_io=False, admission="hit-or-young:5")
    kw = c.embedded_pool_kwargs(dp_rank=1, tp_rank=3, tp_size=4)
    assert kw["ssd_dir"] == [str(a / "dp1-tp3"), str(b / "dp1-tp3")]
    assert all(os.path.isdir(d) for d in kw["ssd_dir"]), "the per-rank directories are created"
    assert (kw["ssd_capacity"], kw["ssd_high_wm"], kw["ssd_low_wm"], kw["ssd_direct_io"], kw["ssd_admission"]) == (
        2 << 30, 0.9, 0.5, False, "hit-or-young:5")
    # The comma-separated form (the environment's) is the same list.
    assert parse({"ssd_dir": f"{a},{b}"}).ssd.dirs == (str(a), str(b))


def test_default_capacity_is_half_the_free_space_split_over_tp_ranks(tmp_path):
    c = parse({"ssd_dir": str(tmp_path)})
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    got = c.ssd.capacity_per_worker(4)
    assert abs(got - free // 2 // 4) <= free // 100, (got, free)
    assert "ssd_admission" not in c.embedded_pool_kwargs(), "the pool's default admission"


def test_seed_environment_spellings(monkeypatch, tmp_path):
    monkeypatch.setenv("UMBP_SSD_DIR", f"{tmp_path}")
    monkeypatch.setenv("UMBP_SSD_CAPACITY", "3GiB")
    monkeypatch.setenv("UMBP_SSD_HIGH_WM", "0.8")
    monkeypatch.setenv("UMBP_SSD_LOW_WM", "0.6")
    monkeypatch.setenv("UMBP_SSD_DIRECT_IO", "0")
    monkeypatch.setenv("UMBP_SSD_ADMISSION", "all")
    monkeypatch.setenv("UMBP_SSD_FLUSH_ON_STOP", "7.5")
    c = parse({})
    assert c.ssd == SsdOptions(dirs=(str(tmp_path),), capacity_bytes=3 << 30, high_watermark=0.8,
                               low_watermark=0.6, direct_io=False, admission="all", flush_on_stop_s=7.5)
    assert c.embedded_pool_kwargs()["ssd_flush_on_stop"] == 7.5
    # A key wins over its environment spelling.
    assert parse({"ssd_capacity": "1GiB"}).ssd.capacity_bytes == 1 << 30
    # UMBP_SSD_ENABLED=0 turns off what only the environment asked for; =1 keeps it.
    monkeypatch.setenv("UMBP_SSD_ENABLED", "0")
    assert parse({}).ssd is None
    assert parse({"ssd_dir": str(tmp_path)}).ssd is not None, "an explicit key is not overridden"
    monkeypatch.setenv("UMBP_SSD_ENABLED", "1")
    assert parse({}).ssd.dirs == (str(tmp_path),)
    # Bad values name the environment variable.
    monkeypatch.setenv("UMBP_SSD_CAPACITY", "lots")
    fails({}, "UMBP_SSD_CAPACITY", "lots")
    monkeypatch.setenv("UMBP_SSD_CAPACITY", "1GiB")
    monkeypatch.setenv("UMBP_SSD_HIGH_WM", "1.5")
    fails({}, "UMBP_SSD_HIGH_WM")
    monkeypatch.setenv("UMBP_SSD_HIGH_WM", "0.5")
    fails({}, "UMBP_SSD_LOW_WM", "must not be above")
    monkeypatch.delenv("UMBP_SSD_HIGH_WM")
    monkeypatch.delenv("UMBP_SSD_LOW_WM")
    monkeypatch.setenv("UMBP_SSD_ENABLED", "maybe")
    fails({}, "UMBP_SSD_ENABLED")


def test_enabled_without_a_directory_is_an_error(monkeypatch):
    monkeypatch.setenv("UMBP_SSD_ENABLED", "1")
    fails({}, "UMBP_SSD_ENABLED", "UMBP_SSD_DIR", "ssd_dir")


@pytest.mark.parametrize("extra,words", [
    ({"ssd_capacity": "1GiB"}, ["ssd_capacity", "without ssd_dir"]),
    ({"ssd_admission": "all"}, ["ssd_admission", "without ssd_dir"]),
    ({"ssd_flush_on_stop": 5}, ["ssd_flush_on_stop", "without ssd_dir"]),
    ({"ssd_dir": "/x", "ssd_flush_on_stop": -1}, ["ssd_flush_on_stop", "seconds"]),
    ({"ssd_dir": "/x", "ssd_flush_on_stop": "soon"}, ["ssd_flush_on_stop", "seconds"]),
    ({"ssd_dir": "/x", "ssd_admission": "sometimes"}, ["ssd_admission", "hit-or-young"]),
    ({"ssd_dir": "/x", "ssd_capacity": "0"}, ["ssd_capacity"]),
    ({"ssd_dir": "/x", "ssd_high_watermark": 0}, ["ssd_high_watermark"]),
    ({"ssd_dir": "/x", "ssd_high_watermark": 0.5, "ssd_low_watermark": 0.7}, ["ssd_low_watermark"]),
    ({"ssd_dir": "/x", "ssd_direct_io": "perhaps"}, ["ssd_direct_io"]),
    ({"ssd_dir": 5}, ["ssd_dir"]),
    ({"ssd_dir": ["/x", "/x"]}, ["ssd_dir", "twice"]),
    ({"ssd_dir": " , "}, ["ssd_dir"]),
    ({"mode": "standalone", "endpoint": "/tmp/p.sock", "ssd_dir": "/x"}, ["ssd_dir", "mode='embedded'"]),
])
def test_bad_values_name_the_key(extra, words):
    fails(extra, *words)


def test_standalone_ignores_the_ssd_environment(monkeypatch):
    # The environment is the standalone pool's (umbp-pool reads the same names).
    monkeypatch.setenv("UMBP_SSD_DIR", "/nonexistent")
    assert parse({"mode": "standalone", "endpoint": "/tmp/p.sock"}).ssd is None


def test_bad_ssd_dir_is_named_when_the_worker_pool_starts(tmp_path):
    missing = tmp_path / "nope"
    c = parse({"ssd_dir": str(missing), "ssd_capacity": "64MiB"})
    with pytest.raises(ValueError) as ei:
        c.embedded_pool_kwargs()
    assert "ssd_dir" in str(ei.value) and str(missing) in str(ei.value) and "does not exist" in str(ei.value)
    assert not missing.exists(), "a mistyped directory is never created"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="ssd_dir.*not a directory"):
        parse({"ssd_dir": str(f), "ssd_capacity": "64MiB"}).embedded_pool_kwargs()


# -- KV event tiers (pure) -----------------------------------------------------------------


def test_tier_event_helpers():
    k1, k2, k3 = b"1" * 16, b"2" * 16, b"3" * 16
    ev = [("stored", k1, "dram"), ("removed", k1, "dram"), ("stored", k1, "ssd"),
          ("stored", k3, "dram"), ("removed", k2)]
    assert last_per_key(ev, {k1, k2}) == {k1: ("stored", "ssd"), k2: ("removed", "dram")}
    assert slowest_tier(["dram", "ssd", "dram"]) == "ssd"
    assert slowest_tier([]) == "dram" and slowest_tier(["dram", "remote", "ssd"]) == "remote"
    assert medium_of("dram") == ("CPU", None) and medium_of("ssd") == ("STORAGE", None)
    assert medium_of("remote") == ("CPU", "REMOTE")


# -- the binding ---------------------------------------------------------------------------


def _writable_as_this_user(p) -> bool:
    return os.access(p, os.W_OK)


def test_binding_refuses_bad_ssd_dirs_naming_option_and_path(native, tmp_path):
    n = native
    missing = tmp_path / "missing"
    with pytest.raises(ValueError) as ei:
        n.EmbeddedPool(8 * MiB, ssd_dir=[str(missing)], ssd_capacity=64 * MiB)
    assert "ssd_dir" in str(ei.value) and str(missing) in str(ei.value), ei.value
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match=f"ssd_dir: {f}: not a directory"):
        n.EmbeddedPool(8 * MiB, ssd_dir=[str(f)], ssd_capacity=64 * MiB)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if _writable_as_this_user(ro):
            print("skipped: read-only directory check (this user writes anyway, e.g. root)")
        else:
            with pytest.raises(ValueError, match=f"ssd_dir: {ro}: not writable"):
                n.EmbeddedPool(8 * MiB, ssd_dir=[str(ro)], ssd_capacity=64 * MiB)
    finally:
        ro.chmod(stat.S_IRWXU)
    with pytest.raises(ValueError, match="ssd_admission"):
        n.EmbeddedPool(8 * MiB, ssd_dir=[str(tmp_path)], ssd_capacity=64 * MiB, ssd_admission="sometimes")
    with pytest.raises(ValueError, match="without ssd_dir"):
        n.EmbeddedPool(8 * MiB, ssd_capacity=64 * MiB)
    with pytest.raises(ValueError, match="ssd_flush_on_stop: expected seconds"):
        n.EmbeddedPool(8 * MiB, ssd_dir=[str(tmp_path)], ssd_capacity=64 * MiB, ssd_flush_on_stop=-1.0)


def _fill(buf, block, seed):
    """Block `block` of `buf` gets bytes that depend on (seed, position)."""
    pattern = bytes(((seed * 131 + i * 7) >> 3) & 0xFF for i in range(256))
    ctypes.memmove(ctypes.addressof(buf) + block * PAGE, pattern * (PAGE // 256), PAGE)


def _block(buf, block):
    return bytes(buf[block * PAGE : (block + 1) * PAGE])


def test_tiny_dram_with_ssd_keeps_several_times_dram_loadable_byte_exact(native, tmp_path, short_tmp):
    """A 4 MiB pool (64 objects) with a 64 MiB SSD directory: 256 objects (4x DRAM) stored
    one batch at a time stay loadable, byte-exact, through the binding; the report and the
    KV events show the SSD tier."""
    n = native
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    pool = n.EmbeddedPool(4 * MiB, socket_path=str(short_tmp / "p.sock"), ssd_dir=[str(ssd)],
                          ssd_capacity=64 * MiB, ssd_admission="all", ssd_direct_io=True)
    try:
        ns = n.namespace_digest("test_ssd_tiny_dram")
        idx = n.Index(pool.socket_path, ns)
        w = n.Worker(pool.socket_path, ns, timeout_ms=10000, startup_timeout_ms=5000)
        slots = 32
        buf = (ctypes.c_ubyte * (slots * PAGE))()
        alloc = w.register_host_memory(ctypes.addressof(buf), len(buf))
        assert w.register_layout(0, [(alloc, 0, PAGE, PAGE, slots)]) == PAGE
        total = 256
        keys = n.object_keys(ns, 0, 0, [i.to_bytes(4, "little") for i in range(total)])
        for start in range(0, total, 16):
            for j in range(16):
                _fill(buf, j, start + j)
            # A store that finds DRAM full while the evictor is still demoting is
            # NOT_STORED (stores never wait): retried.
            todo = list(range(16))
            for _ in range(100):
                got = w.wait(w.store(0, [keys[start + j] for j in todo], todo), 10000)
                assert set(got) <= {n.STATUS_STORED, n.STATUS_NOT_STORED}, (start, got)
                todo = [j for j, st in zip(todo, got) if st == n.STATUS_NOT_STORED]
                if not todo:
                    break
                time.sleep(0.05)
            assert not todo, f"stores kept finding no room at {start}"
        report = json.loads(pool.report())
        assert report["ssd"] is not None and report["ssd"]["demotions"] > 0, report.get("ssd")
        # Every object is still loadable, byte-exact (most of them promoted from SSD).
        ctypes.memset(buf, 0, len(buf))
        for start in range(0, total, 16):
            got = w.wait(w.load(0, keys[start:start + 16], list(range(16, 32))), 10000)
            assert got == [n.STATUS_LOADED] * 16, (start, got)
            for j in range(16):
                _fill(buf, j, start + j)
                assert _block(buf, 16 + j) == _block(buf, j), f"object {start + j} differs"
        report = json.loads(pool.report())
        s = report["ssd"]
        assert s["promotions"] > 0 and s["crc_misses"] == 0 and s["promotion_failures"] == 0, s
        assert report["tiers"]["dram"] + report["tiers"]["ssd"] == total, report["tiers"]
        # The events carry the tier: a demotion is removed from DRAM, stored on SSD.
        events = idx.take_tier_events()
        assert all(t in ("dram", "ssd") for _, _, t in events)
        assert any(k == "stored" and t == "ssd" for k, _, t in events)
        assert any(k == "removed" and t == "dram" for k, _, t in events)
        # The SSD directory holds segment files.
        assert any(p.name.startswith("seg-") for p in ssd.iterdir())
        w.close()
    finally:
        pool.close()


@pytest.mark.parametrize("flush", [5.0, 0.0])
def test_close_writes_dram_objects_to_ssd_for_the_next_pool(native, tmp_path, short_tmp, flush):
    """16 objects that fit in DRAM (never demoted) survive `close()` and a new pool on the same
    directory when `ssd_flush_on_stop` allows it; with 0 they are gone (the control)."""
    n = native
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    ns = n.namespace_digest("test_ssd_flush_on_stop")
    keys = n.object_keys(ns, 0, 0, [i.to_bytes(4, "little") for i in range(16)])
    buf = (ctypes.c_ubyte * (32 * PAGE))()

    def pool_and_worker(sock):
        pool = n.EmbeddedPool(8 * MiB, socket_path=str(short_tmp / sock), ssd_dir=[str(ssd)],
                              ssd_capacity=64 * MiB, ssd_admission="all", ssd_flush_on_stop=flush)
        w = n.Worker(pool.socket_path, ns, timeout_ms=10000, startup_timeout_ms=5000)
        alloc = w.register_host_memory(ctypes.addressof(buf), len(buf))
        assert w.register_layout(0, [(alloc, 0, PAGE, PAGE, 32)]) == PAGE
        return pool, w

    pool, w = pool_and_worker("a.sock")
    try:
        for j in range(16):
            _fill(buf, j, j)
        assert w.wait(w.store(0, keys, list(range(16))), 10000) == [n.STATUS_STORED] * 16
        report = json.loads(pool.report())
        assert report["tiers"]["dram"] == 16 and report["tiers"]["ssd"] == 0, report["tiers"]
        w.close()
    finally:
        pool.close()
    pool, w = pool_and_worker("b.sock")
    try:
        got = w.wait(w.load(0, keys, list(range(16, 32))), 10000)
        if flush == 0:
            assert got == [n.STATUS_MISSING] * 16, got
        else:
            assert got == [n.STATUS_LOADED] * 16, got
            for j in range(16):
                assert _block(buf, 16 + j) == _block(buf, j), f"object {j} differs"
        w.close()
    finally:
        pool.close()


def test_restamp_sets_medium_and_locality_on_vllm_events():
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from umbp.vllm.tier_events import restamp

    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                     lora_id=None, medium="CPU", lora_name=None, group_idx=0)
    s = restamp(ev, "ssd")
    assert (s.medium, s.locality, s.token_ids, s.block_hashes) == ("STORAGE", None, [1, 2], [1])
    assert ev.medium == "CPU", "the original is unchanged"
    r = restamp(BlockRemoved(block_hashes=[1], medium="CPU"), "remote")
    assert (r.medium, r.locality) == ("CPU", "REMOTE")
