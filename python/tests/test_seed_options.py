"""The seed connector's options (issue #15): each one parsed, and each one with its effect
observed on a real pool or a real vLLM scheduler — or, where it cannot mean anything in
this design, accepted and logged once with the reason.

Pure parsing needs only vLLM; the pool knobs need the compiled `umbp._native`; the
connector-level checks drive vLLM's real `Scheduler` (sched_harness.py)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from conftest import harness_factory, options_fail as fails, parse_options as parse

pytest.importorskip("vllm")

from umbp.vllm import config as C  # noqa: E402

MiB = 1 << 20
BLOCK = 128


pytestmark = pytest.mark.usefixtures("clean_connector_env")


# -- parsing ------------------------------------------------------------------------------


def test_new_keys_defaults():
    c = parse({})
    assert (c.dram_use_hugepages, c.dram_hugepage_size, c.dram_numa_node, c.dram_prefault) == (
        False, 2 * MiB, None, False)
    assert (c.lookup_dir, c.num_workers, c.kv_event_max_objects, c.notes) == (None, None, 65536, ())
    # Only what the user set reaches the pool: its own defaults otherwise.
    assert c.embedded_pool_kwargs() == {"high_wm": 0.9, "low_wm": 0.7}


def test_embedded_pool_knobs_reach_the_pool_kwargs(short_tmp):
    c = parse({"dram_use_hugepages": "true", "dram_hugepage_size": "2MiB", "dram_numa_node": 0,
               "dram_prefault": 1, "num_workers": 3, "dram_high_watermark": 0.8,
               "dram_low_watermark": 0.5, "lookup_dir": str(short_tmp)})
    assert c.embedded_pool_kwargs() == {"high_wm": 0.8, "low_wm": 0.5, "hugepages": True,
                                        "numa_node": 0, "prefault": True, "copy_threads": 3}
    assert c.lookup_dir == str(short_tmp) and c.notes == ()


@pytest.mark.parametrize("size", ["1GiB", "4KiB", 4096, "3MiB"])
def test_hugepage_sizes_other_than_2mib_are_refused(size):
    fails({"dram_use_hugepages": True, "dram_hugepage_size": size}, "dram_hugepage_size", "2 MiB")


def test_hugepage_size_without_hugepages_is_noted():
    c = parse({"dram_hugepage_size": "2M"})
    assert len(c.notes) == 1 and "dram_use_hugepages" in c.notes[0]


@pytest.mark.parametrize("key,value", [("dram_numa_node", -1), ("dram_numa_node", "x"),
                                       ("dram_numa_node", True), ("num_workers", 0),
                                       ("num_workers", "many"), ("kv_event_max_objects", 0),
                                       ("dram_prefault", "maybe"), ("dram_use_hugepages", 2),
                                       ("lookup_dir", ""), ("lookup_dir", 5)])
def test_new_keys_rejected(key, value):
    fails({key: value}, key)


@pytest.mark.parametrize("key,value", [("dram_use_hugepages", True), ("dram_hugepage_size", "2MiB"),
                                       ("dram_numa_node", 0), ("dram_prefault", True),
                                       ("lookup_dir", "/tmp")])
def test_pool_owning_keys_rejected_in_standalone(key, value):
    fails({"mode": "standalone", "endpoint": "/tmp/x.sock", key: value}, key, "embedded")


def test_lookup_dir_too_long_is_refused():
    fails({"lookup_dir": "/tmp/" + "d" * 80}, "lookup_dir", "107")


def test_inert_options_are_logged_once():
    c = parse({"lookup_async": True})
    assert c.lookup_async and len(c.notes) == 1 and "no effect" in c.notes[0]
    s = parse({"mode": "standalone", "endpoint": "/tmp/x.sock", "num_workers": 8})
    assert s.num_workers == 8 and "copy-threads" in s.notes[0]
    # Logged once per process: a second identical config logs nothing new.
    note = "test-only note " + str(time.time())
    assert C.log_notes_once((note,)) == [note]
    assert C.log_notes_once((note,)) == []


# -- endpoint ------------------------------------------------------------------------------


@pytest.mark.parametrize("value,path", [("unix:///run/umbp/pool.sock", "/run/umbp/pool.sock"),
                                        ("UNIX:///tmp/a.sock", "/tmp/a.sock"),
                                        ("/tmp/b.sock", "/tmp/b.sock"),
                                        ("rel/c.sock", "rel/c.sock")])
def test_unix_endpoints(value, path):
    c = parse({"mode": "standalone", "endpoint": value})
    assert c.endpoint == path and c.lookup_instance == path
    c = parse({"mode": "standalone", "endpoint": "/tmp/e.sock", "lookup_instance": value})
    assert c.lookup_instance == path


@pytest.mark.parametrize("value", ["tcp://127.0.0.1:5555", "127.0.0.1:5555", "localhost:8000",
                                   "http://pool:80", "[::1]:5555", "grpc://x"])
def test_tcp_endpoints_are_refused(value):
    msg = fails({"mode": "standalone", "endpoint": value}, "endpoint", "only unix sockets are supported")
    assert value in msg
    fails({"mode": "standalone", "endpoint": "/tmp/e.sock", "lookup_instance": value},
          "lookup_instance", "only unix sockets")


def test_tcp_address_from_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(C.ENV_STANDALONE_ADDRESS, "tcp://10.0.0.1:9000")
    fails({"mode": "standalone"}, C.ENV_STANDALONE_ADDRESS, "only unix sockets")
    monkeypatch.setenv(C.ENV_STANDALONE_ADDRESS, "unix:///tmp/env.sock")
    assert parse({"mode": "standalone"}).endpoint == "/tmp/env.sock"


def test_unix_endpoint_attaches_to_a_real_pool(native, short_tmp):
    """A unix:// address reaches a real pool (the worker's Worker connects to the path)."""
    sock = short_tmp / "p.sock"
    pool = native.EmbeddedPool(8 * MiB, socket_path=str(sock))
    try:
        c = parse({"mode": "standalone", "endpoint": f"unix://{sock}"})
        w = native.Worker(c.endpoint, b"\0" * 16, startup_timeout_ms=2000)
        assert w.connected
        w.close()
    finally:
        pool.close()


# -- lookup_dir ------------------------------------------------------------------------------


def test_lookup_dir_places_the_sockets(tmp_path):
    from umbp.vllm.endpoints import embedded_socket_path

    d = tmp_path / "sockets"
    p = embedded_socket_path("/nonexistent/default.sock", "engine-1", 2, 3, lookup_dir=str(d))
    assert Path(p).parent == d and d.is_dir() and p.endswith("-dp2-tp3.sock")
    assert p != embedded_socket_path("/x/y.sock", "engine-1", 2, 3)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="lookup_dir"):
        embedded_socket_path("/x/y.sock", "e", 0, 0, lookup_dir=str(blocker / "sub"))


# -- embedded pool knobs on a real pool (native) ------------------------------------------


def _threads(prefix: str) -> int:
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            if Path(f"/proc/self/task/{t}/comm").read_text().startswith(prefix):
                n += 1
        except OSError:
            pass
    return n


def _settled_threads(prefix: str) -> int:
    """`_threads(prefix)` once pools closed by earlier tests have finished exiting."""
    import gc

    gc.collect()
    last, deadline = _threads(prefix), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = _threads(prefix)
        if now == last:
            return now
        last = now
    return last


def _new_threads(prefix: str, before: int, want: int) -> int:
    """Threads named `prefix*` beyond `before`, once `want` of them are there (Rust names a
    thread from inside it, when it first runs: on a loaded machine that can take a while)."""
    deadline = time.monotonic() + 20
    while _threads(prefix) - before < want and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # and no more than that
    return _threads(prefix) - before


def _meminfo_kb(field: str, path: str = "/proc/self/status") -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in {path}")


def test_num_workers_sets_the_copy_threads(native, short_tmp):
    for sock, n in (("a.sock", 5), ("b.sock", 1)):
        before = _settled_threads("umbp-copy-")
        pool = native.EmbeddedPool(8 * MiB, socket_path=str(short_tmp / sock), copy_threads=n)
        try:
            assert _new_threads("umbp-copy-", before, n) == n
        finally:
            pool.close()


def test_prefault_faults_the_dram_in(native, short_tmp):
    size = 256 * MiB
    base = _meminfo_kb("RssShmem")
    pool = native.EmbeddedPool(size, socket_path=str(short_tmp / "a.sock"))
    try:
        lazy = _meminfo_kb("RssShmem") - base
    finally:
        pool.close()
    base = _meminfo_kb("RssShmem")
    pool = native.EmbeddedPool(size, socket_path=str(short_tmp / "b.sock"), prefault=True)
    try:
        eager = _meminfo_kb("RssShmem") - base
    finally:
        pool.close()
    assert lazy < 64 * 1024, f"without prefault {lazy} KiB resident already"
    assert eager >= size // 1024 - 1024, f"prefault made only {eager} KiB resident"


def test_numa_node_binds_or_names_the_node(native, short_tmp):
    pool = native.EmbeddedPool(8 * MiB, socket_path=str(short_tmp / "a.sock"), numa_node=0)
    pool.close()
    with pytest.raises(native.UmbpError, match="numa-node 1000"):
        native.EmbeddedPool(8 * MiB, socket_path=str(short_tmp / "b.sock"), numa_node=1000)


def test_hugepages_use_the_reserved_pages(native, short_tmp):
    free = _meminfo_kb("HugePages_Free", "/proc/meminfo")
    hp = _meminfo_kb("Hugepagesize", "/proc/meminfo")
    if free * 1024 < 8 * MiB or hp != 2048:
        # Nothing reserved: the option must fail loudly, naming the reservation needed.
        with pytest.raises(native.UmbpError, match="nr_hugepages"):
            native.EmbeddedPool(8 * MiB, socket_path=str(short_tmp / "a.sock"), hugepages=True)
        print("skipped: no 2 MiB huge pages reserved here; checked the refusal only")
        return
    pool = native.EmbeddedPool(8 * MiB, socket_path=str(short_tmp / "a.sock"), hugepages=True, prefault=True)
    try:
        assert _meminfo_kb("HugePages_Free", "/proc/meminfo") <= free - 4
    finally:
        pool.close()


def test_watermarks_bound_what_the_pool_keeps(make_harness):
    """64 objects fit; with watermarks 0.5/0.25 the evictor keeps the pool at or under half."""
    from sched_harness import tokens

    h = make_harness(extra={"capacity_bytes": "4MiB", "dram_high_watermark": 0.5,
                            "dram_low_watermark": 0.25})
    for i in range(12):
        h.add(f"r{i}", tokens(300 + i, 4 * BLOCK + 10))
    h.run(timeout=60)
    time.sleep(0.3)  # the evictor runs on its own thread
    pool = h.pool_report()["pool"]
    assert (pool["high_watermark"], pool["low_watermark"]) == (0.5, 0.25)
    assert pool["evictions"] > 0
    assert pool["allocated_bytes"] <= 0.5 * pool["capacity_bytes"], pool


# -- through the connector: vLLM's real Scheduler --------------------------------------------


@pytest.fixture
def make_harness(cfg_dir, native):
    yield from harness_factory(cfg_dir, {"capacity_bytes": "16MiB", "key_namespace": "seed-options"})


def test_connector_pool_options_take_effect(make_harness, short_tmp):
    before = _settled_threads("umbp-copy-")
    h = make_harness(extra={"num_workers": 3, "lookup_dir": str(short_tmp / "lk"),
                            "dram_numa_node": 0})
    path = Path(h.worker._worker.endpoint)
    assert path.parent == short_tmp / "lk" and path.is_socket()
    assert _new_threads("umbp-copy-", before, 3) == 3
    # The scheduler's lookups read the pool in lookup_dir: a stored prompt hits.
    from sched_harness import tokens

    toks = tokens(11, 300)
    h.add("a", toks)
    h.run()
    h.reset_local_cache()
    assert h.conn.get_num_new_matched_tokens(h.request("b", toks), 0)[0] == 256


def test_kv_event_max_objects_suppresses_until_blocks_leave(make_harness):
    from sched_harness import tokens

    h = make_harness(events=True, extra={"kv_event_max_objects": 3})
    a, b = tokens(21, 4 * BLOCK + 10), tokens(22, 4 * BLOCK + 10)
    h.add("a", a)
    h.run()
    stored = [e for e in h.recorder.take() if type(e).__name__ == "BlockStored"]
    assert len(stored) == 3, "only kv_event_max_objects blocks are announced"
    h.add("b", b)
    h.run()
    assert h.recorder.take() == [], "full: no new BlockStored"
    s = h.connector_stats()
    assert s["stored_blocks"] == 8, "storing goes on"
    # Lookups go on too: all 4 blocks of both prompts hit.
    h.reset_local_cache()
    for rid, toks in (("a2", a), ("b2", b)):
        assert h.conn.get_num_new_matched_tokens(h.request(rid, toks), 0)[0] == 4 * BLOCK
    # Tracked blocks leave the pool (reset drops them): BlockRemoved, then room again.
    h.conn.reset_cache()
    deadline = time.monotonic() + 10
    removed = []
    while len(removed) < 3 and time.monotonic() < deadline:
        h.step()
        removed += [e for e in h.recorder.take() if type(e).__name__ == "BlockRemoved"]
        time.sleep(0.02)
    assert len(removed) == 3
    h.add("c", tokens(23, 2 * BLOCK + 10))
    h.run()
    assert len([e for e in h.recorder.take() if type(e).__name__ == "BlockStored"]) == 2


def test_prefix_caching_off_warns():
    assert C.prefix_caching_warning(True) is None
    msg = C.prefix_caching_warning(False)
    assert "prefix caching is off" in msg and "enable-prefix-caching" in msg


# -- Prometheus ---------------------------------------------------------------------------------


def test_metrics_in_vllms_prometheus_output(cfg_dir):
    """vLLM's own PrometheusStatLogger builds our counters (build_prom_metrics) and exports
    what the connector's stats carry."""
    import prometheus_client
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    from umbp.vllm.stats import COUNTERS, PROM_COUNTERS, PROM_PREFIX

    assert set(PROM_COUNTERS) == set(COUNTERS)
    ktc = {"kv_connector": "UMBPStoreConnector", "kv_connector_module_path": "umbp.vllm",
           "kv_role": "kv_both"}
    vc = EngineArgs(model=cfg_dir, skip_tokenizer_init=True, enable_prefix_caching=True,
                    enforce_eager=True, max_model_len=1024, kv_transfer_config=ktc).create_engine_config()
    logger = PrometheusStatLogger(vc, engine_indexes=[0])
    data = {k: 0 for k in COUNTERS}
    data.update(lookups=3, lookup_hit_tokens=256, load_bytes=4096, load_ns=2_000_000_000)
    logger.record(scheduler_stats=SchedulerStats(kv_connector_stats=data), iteration_stats=None, engine_idx=0)
    text = prometheus_client.generate_latest().decode()
    for name, _ in PROM_COUNTERS.values():
        assert f"{PROM_PREFIX}{name}_total" in text, f"{name} missing from /metrics"

    def value(name):
        for line in text.splitlines():
            if line.startswith(f"{PROM_PREFIX}{name}_total{{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(name)

    assert (value("lookups"), value("lookup_hit_tokens"), value("load_bytes")) == (3, 256, 4096)
    assert value("load_seconds") == pytest.approx(2.0)


def test_sleep_mode_is_refused():
    """vLLM >= 0.33 asks the connector before enabling sleep mode (which remaps the KV
    memory the pool has registered): the answer must be no."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from umbp.vllm import UMBPStoreConnector

    assert UMBPStoreConnector.supports_sleep_mode(None) is False
    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        print("skipped: this vLLM has no supports_sleep_mode hook (< 0.33); checked the answer only")
