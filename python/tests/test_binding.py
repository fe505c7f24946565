"""The umbp._native binding against real pools (embedded in this process and a real
umbp-pool process): keys, store/load round trips byte-exact, index lookups, errors."""

import ctypes
import subprocess
import time

import pytest

n = None


@pytest.fixture(autouse=True)
def _n(native):
    global n
    n = native

PAGE = 4096
BLOCKS = 16
LAYERS = 2


def _buffer(size, fill):
    buf = (ctypes.c_ubyte * size)()
    ctypes.memset(buf, fill, size)
    return buf


def _attach(endpoint, ns):
    w = n.Worker(endpoint, ns, timeout_ms=5000, startup_timeout_ms=5000)
    buf = _buffer(LAYERS * BLOCKS * PAGE, 0)
    alloc = w.register_host_memory(ctypes.addressof(buf), len(buf))
    segs = [(alloc, layer * BLOCKS * PAGE, PAGE, PAGE, BLOCKS) for layer in range(LAYERS)]
    assert w.register_layout(0, segs) == LAYERS * PAGE
    return w, buf


def _page(buf, layer, block):
    off = layer * BLOCKS * PAGE + block * PAGE
    return bytes(buf[off : off + PAGE])


def test_keep_attached_reattaches_an_idle_worker(short_tmp, pool_bin):
    """Issue #33 item 8: a worker nobody calls re-attaches to a restarted pool within about a
    second when its keep-attached timer runs; the same worker without one stays detached
    until its next call (the control)."""
    from umbp.vllm.keep_attached import KeepAttached

    sock = str(short_tmp / "pool.sock")
    cmd = [str(pool_bin), "--socket", sock, "--capacity", "64MiB", "--min-object-size", "4KiB"]
    proc = subprocess.Popen(cmd)
    keeper = None
    try:
        ns = n.namespace_digest("keep-attached")
        kept, kept_buf = _attach(sock, ns)
        idle, idle_buf = _attach(sock, ns)
        keeper = KeepAttached(kept, interval_s=0.1)
        proc.kill()
        proc.wait()
        deadline = time.time() + 5
        while kept.connected and time.time() < deadline:
            time.sleep(0.02)
        assert not kept.connected, "the timer noticed the dead pool"
        proc = subprocess.Popen(cmd)
        t0 = time.time()
        deadline = t0 + 5
        while not kept.connected and time.time() < deadline:
            time.sleep(0.02)
        took = time.time() - t0
        assert kept.connected, "the idle worker with a keep-attached timer did not re-attach within 5 s"
        assert took < 2.0, f"re-attach took {took:.2f} s"
        assert not idle.connected, "the control: a worker nobody calls stays detached"
        # The re-attach re-registered memory and layouts: a store lands at once.
        keys = n.object_keys(ns, 0, 0, [b"k"])
        assert kept.wait(kept.store(0, keys, [0]), 5000) == [n.STATUS_STORED]
    finally:
        if keeper is not None:
            keeper.stop()
        proc.kill()
        proc.wait()


def test_keys_are_stable_and_distinct():
    ns = n.namespace_digest("model=x;dtype=bf16")
    assert len(ns) == 16 and ns == n.namespace_digest("model=x;dtype=bf16")
    k = n.object_key(ns, 0, 0, b"hash")
    assert len(k) == 16
    assert k != n.object_key(ns, 0, 1, b"hash")
    assert n.object_keys(ns, 0, 0, [b"hash", b"h2"])[0] == k
    with pytest.raises(ValueError, match="namespace must be 16 bytes"):
        n.object_key(b"short", 0, 0, b"x")
    assert n.parse_size("capacity_bytes", "2GiB") == 2 << 30
    with pytest.raises(ValueError, match="capacity_bytes"):
        n.parse_size("capacity_bytes", "plenty")


def test_embedded_pool_round_trip_and_index():
    ns = n.namespace_digest("test_embedded_pool_round_trip")
    pool = n.EmbeddedPool(64 << 20, min_object_bytes=PAGE)
    try:
        w, buf = _attach(pool.socket_path, ns)
        for b in range(BLOCKS):
            for layer in range(LAYERS):
                off = layer * BLOCKS * PAGE + b * PAGE
                ctypes.memset(ctypes.addressof(buf) + off, (b * 7 + layer) & 0xFF, PAGE)
        keys = n.object_keys(ns, 0, 0, [bytes([i]) for i in range(BLOCKS)])
        statuses = w.wait(w.store(0, keys[:8], list(range(8))), 5000)
        assert statuses == [n.STATUS_STORED] * 8
        idx = n.Index(pool.socket_path, ns)
        assert idx.match_prefix(keys) == 8
        assert idx.contains(keys[0]) and not idx.contains(keys[9])
        hashes = [bytes([i]) for i in range(BLOCKS)]
        assert idx.match_hashes(ns, 0, 0, hashes) == 8  # keys derived in the binding
        assert idx.match_hashes(ns, 0, 1, hashes) == 0  # another rank's keys
        assert idx.match_hashes(ns, 0, 0, hashes[1:]) == 7 and idx.match_hashes(ns, 0, 0, hashes[8:]) == 0
        # Load block 0..7's objects into blocks 8..15 and compare bytes.
        statuses = w.wait(w.load(0, keys[:8], list(range(8, 16))), 5000)
        assert statuses == [n.STATUS_LOADED] * 8
        for b in range(8):
            for layer in range(LAYERS):
                assert _page(buf, layer, b + 8) == _page(buf, layer, b)
        assert w.wait(w.load(0, [keys[12]], [0]), 5000) == [n.STATUS_MISSING]
        assert w.wait(w.store(0, [keys[0]], [3]), 5000) == [n.STATUS_ALREADY_PRESENT]
        report = __import__("json").loads(pool.report())
        assert report["pool"]["published_objects"] == 8
        assert w.reset_namespace() == 8
        assert idx.match_prefix(keys) == 0
        with pytest.raises(ValueError, match="2 keys but 1 block ids"):
            w.store(0, keys[:2], [0])
        with pytest.raises(n.UmbpError, match="no registered layout"):
            w.store(5, keys[:1], [0])
        w.close()
    finally:
        pool.close()


def test_index_take_events_reports_stores_and_removals():
    ns = n.namespace_digest("test_index_take_events")
    pool = n.EmbeddedPool(64 << 20, min_object_bytes=PAGE)
    try:
        idx = n.Index(pool.socket_path, ns)
        assert idx.take_events() == []
        w, _buf = _attach(pool.socket_path, ns)
        keys = n.object_keys(ns, 0, 0, [bytes([i]) for i in range(6)])
        assert w.wait(w.store(0, keys, list(range(6))), 5000) == [n.STATUS_STORED] * 6
        events = idx.take_events()
        assert sorted(events) == sorted(("stored", k) for k in keys)
        assert all(isinstance(k, bytes) and len(k) == 16 for _, k in events)
        assert idx.take_events() == [], "each event is returned once"
        assert w.reset_namespace() == 6
        assert sorted(idx.take_events()) == sorted(("removed", k) for k in keys)
        assert idx.events_lost == 0
        w.close()
    finally:
        pool.close()


def test_unreachable_pool_names_the_socket(short_tmp):
    path = str(short_tmp / "nobody.sock")
    with pytest.raises(n.UmbpError, match=path):
        n.Worker(path, b"\0" * 16, startup_timeout_ms=200)
    with pytest.raises(n.UmbpError, match=path):
        n.Index(path, timeout_ms=200)
    lazy = n.Index(path, timeout_ms=0)
    assert lazy.match_prefix([b"\1" * 16]) == 0 and not lazy.connected


def test_standalone_pool_process_restart(short_tmp, pool_bin):
    sock = str(short_tmp / "pool.sock")
    cmd = [str(pool_bin), "--socket", sock, "--capacity", "64MiB", "--min-object-size", "4KiB"]
    proc = subprocess.Popen(cmd)
    try:
        ns = n.namespace_digest("restart")
        w, buf = _attach(sock, ns)
        keys = n.object_keys(ns, 0, 0, [b"a", b"b"])
        assert w.wait(w.store(0, keys, [0, 1]), 5000) == [n.STATUS_STORED] * 2
        idx = n.Index(sock, ns)
        assert idx.match_prefix(keys) == 2
        proc.kill()
        proc.wait()
        assert idx.match_prefix(keys) == 0, "a dead pool's index never hits"
        proc = subprocess.Popen(cmd)
        deadline = time.time() + 10
        while not w.connected and time.time() < deadline:
            w.poll()
            time.sleep(0.05)
        assert w.connected, "worker re-attached to the restarted pool"
        assert w.wait(w.store(0, keys, [0, 1]), 5000) == [n.STATUS_STORED] * 2
        deadline = time.time() + 10
        while idx.match_prefix(keys) != 2 and time.time() < deadline:
            time.sleep(0.05)
        assert idx.match_prefix(keys) == 2
    finally:
        proc.kill()
        proc.wait()
