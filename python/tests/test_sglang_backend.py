"""umbp.sglang against SGLang's real classes, attached to a real `umbp-pool` process: its
HiCacheController and HybridCacheController (storage threads running, CPU device pool),
its CPU host pools (MHATokenToKVPoolHost, MambaPoolHost), its page hash function and its
backend factory (`--hicache-storage-backend dynamic`). No SGLang engine runs (SGLang's CPU
engine needs the CPU build of sgl_kernel, which is not on PyPI; docs/sglang.md).

Skipped, with the reason printed, when SGLang is not importable (CI's venv has no SGLang;
scripts/setup-sglang-env.sh makes one that has it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:
    print("test_sglang_backend: skipped: sglang is not importable (scripts/setup-sglang-env.sh)")
    pytest.skip("sglang is not importable (run scripts/setup-sglang-env.sh)", allow_module_level=True)

import torch  # noqa: E402

import sglang_host as sh  # noqa: E402
from conftest import _ADD_PY_DIR  # noqa: E402

HERE = Path(__file__).resolve().parent


def _driver(*args: str, timeout: float = 300) -> dict:
    env = dict(os.environ)
    # The source tree only where umbp is not installed (a source tree has no _native module).
    path = [str(HERE)] + ([str(HERE.parent)] if _ADD_PY_DIR else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path)
    r = subprocess.run([sys.executable, "-W", "ignore", str(HERE / "sglang_host.py"), *args],
                       env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, f"driver {args} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_store_in_one_process_hit_and_exact_load_in_another(pool_factory) -> None:
    pool = pool_factory()
    w = _driver("store", str(pool.socket_path), "page_first", "11", "6")
    assert w["ok"] == [True] * 6
    r = _driver("load", str(pool.socket_path), "page_first", "11", "6")
    assert r["pid"] != w["pid"]
    assert r["hit"] == 6
    assert r["ok"] == [True] * 6
    assert r["exact"] == [True] * 6
    # Different tokens: a miss, nothing loaded.
    m = _driver("load", str(pool.socket_path), "page_first", "12", "2")
    assert m["hit"] == 0 and m["ok"] == [False, False]


def _pair(layout: str, sock: str, **extra):
    a, b = sh.host_pool(layout), sh.host_pool(layout)
    return a, sh.make_backend(a, sh.umbp_extra(sock, **extra)), b, sh.make_backend(b, sh.umbp_extra(sock, **extra))


def _exact(hp_a, ia, hp_b, ib, n) -> bool:
    ps = hp_a.page_size
    return all(sh.page_bytes(hp_a, int(ia[i * ps])) == sh.page_bytes(hp_b, int(ib[i * ps])) for i in range(n))


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct", "page_head"])
def test_layouts_roundtrip_between_two_backends(pool_factory, layout: str) -> None:
    pool = pool_factory()
    ha, a, hb, b = _pair(layout, str(pool.socket_path))
    keys = sh.page_hashes(sh.tokens_of(3, 4))
    ia = ha.alloc(4 * ha.page_size)
    sh.fill_pages(ha, ia, 3)
    assert b.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, ia) == [True] * 4
    assert b.batch_exists(keys) == 4
    assert b.batch_exists(keys[:2] + sh.page_hashes(sh.tokens_of(4, 1))) == 2  # prefix semantics
    hb.alloc(5 * hb.page_size)
    ib = hb.alloc(4 * hb.page_size)
    assert b.batch_get_v1(keys, ib) == [True] * 4
    assert _exact(ha, ia, hb, ib, 4)
    # A second store of the same pages is "already present": still a success.
    assert a.batch_set_v1(keys, ia) == [True] * 4


def test_pool_killed_misses_no_crash_then_recovers(pool_factory) -> None:
    pool = pool_factory()
    hp = sh.host_pool("page_first")
    b = sh.make_backend(hp, sh.umbp_extra(str(pool.socket_path), timeout_ms=500))
    keys = sh.page_hashes(sh.tokens_of(21, 3))
    idx = hp.alloc(3 * hp.page_size)
    sh.fill_pages(hp, idx, 21)
    assert b.batch_set_v1(keys, idx) == [True] * 3
    assert b.batch_exists(keys) == 3
    pool.kill()
    t0 = time.monotonic()
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, idx) == [False] * 3
    assert b.batch_set_v1(keys, idx) == [False] * 3
    assert b.exists(keys[0]) is False
    assert time.monotonic() - t0 < 10, "a dead pool must not stall the calls"
    pool.start()  # a new, empty pool on the same socket
    deadline = time.monotonic() + 30
    ok = []
    while time.monotonic() < deadline:
        ok = b.batch_set_v1(keys, idx)
        if ok == [True] * 3 and b.batch_exists(keys) == 3:
            break
        time.sleep(0.2)
    assert ok == [True] * 3, "the backend did not re-attach to the restarted pool"
    assert b.batch_exists(keys) == 3
    hp2 = sh.host_pool("page_first")
    b2 = sh.make_backend(hp2, sh.umbp_extra(str(pool.socket_path)))
    i2 = hp2.alloc(3 * hp2.page_size)
    assert b2.batch_get_v1(keys, i2) == [True] * 3
    assert _exact(hp, idx, hp2, i2, 3)


def _vllm_keys():
    """umbp/vllm/keys.py itself (pure Python); loaded from its file when the `umbp.vllm`
    package cannot be imported (its __init__ imports vLLM, which an SGLang venv may lack)."""
    try:
        from umbp.vllm import keys

        return keys
    except ImportError:
        import importlib.util as iu

        import umbp

        spec = iu.spec_from_file_location("_umbp_vllm_keys", Path(umbp.__file__).parent / "vllm" / "keys.py")
        mod = iu.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


def test_vllm_and_sglang_objects_never_collide(pool_factory, native) -> None:
    """The same hash bytes stored by a vLLM connector worker are invisible to the SGLang
    backend and vice versa: the namespaces (hence keys) differ by engine."""
    from umbp._keys_common import make_keys

    canonical_namespace_text = _vllm_keys().canonical_namespace_text

    pool = pool_factory()
    hp = sh.host_pool("page_first")
    sg = sh.make_backend(hp, sh.umbp_extra(str(pool.socket_path)))
    keys = sh.page_hashes(sh.tokens_of(31, 2))
    hashes = [k.encode() for k in keys]  # the exact bytes the SGLang backend keys on
    # The vLLM connector's own namespace function, for a model of the same name and dtype.
    vcfg = SimpleNamespace(
        model_config=SimpleNamespace(model=sh.MODEL, revision=None, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=sh.PAGE),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    vns = bytes(native.namespace_digest(canonical_namespace_text(vcfg, SimpleNamespace(kv_cache_groups=[]))))
    assert vns != sg.namespace
    vkeys = make_keys(native, vns, 0, 0, hashes)
    assert set(vkeys).isdisjoint(sg.keys_of(keys))
    # A vLLM-style worker stores those hash bytes into its own registered memory.
    page = sg.layout.object_bytes
    buf = torch.arange(2 * page, dtype=torch.int64).to(torch.uint8)
    vw = native.Worker(str(pool.socket_path), vns)
    alloc = vw.register_host_memory(buf.data_ptr(), buf.numel())
    vw.register_layout(0, [(alloc, 0, page, page, 2)])
    st = vw.wait(vw.store(0, vkeys, [0, 1]), 5000)
    assert list(st) == [native.STATUS_STORED] * 2
    vidx = native.Index(str(pool.socket_path), namespace=vns)
    assert vidx.match_prefix(vkeys) == 2
    assert sg.batch_exists(keys) == 0
    assert sg.batch_get_v1(keys, hp.alloc(2 * hp.page_size)) == [False, False]
    # And the other way round.
    idx = hp.alloc(2 * hp.page_size)
    sh.fill_pages(hp, idx, 31)
    assert sg.batch_set_v1(keys, idx) == [True, True]
    assert vidx.match_hashes(vns, 0, 0, hashes) == 2  # still only vLLM's own two
    before = bytes(buf.numpy())
    st = vw.wait(vw.load(0, vkeys, [0, 1]), 5000)
    assert list(st) == [native.STATUS_LOADED] * 2 and bytes(buf.numpy()) == before
    vw.close()


def test_namespace_separates_models_dtypes_salts_and_layouts(pool_factory) -> None:
    pool = pool_factory()
    s = str(pool.socket_path)
    hp = sh.host_pool("page_first")
    base = sh.make_backend(hp, sh.umbp_extra(s)).namespace
    assert sh.make_backend(hp, sh.umbp_extra(s)).namespace == base  # deterministic
    others = [
        sh.make_backend(hp, sh.umbp_extra(s, cache_salt="tenant-a")).namespace,
        sh.make_backend(hp, sh.umbp_extra(s, model_revision="v2")).namespace,
        sh.make_backend(hp, sh.umbp_extra(s), model="other/model").namespace,
        sh.make_backend(sh.host_pool("layer_first"), sh.umbp_extra(s)).namespace,
        sh.make_backend(sh.host_pool("page_first", dtype=torch.float16), sh.umbp_extra(s)).namespace,
    ]
    assert len({base, *others}) == 6


def test_copying_path_without_interface_v1(pool_factory) -> None:
    """SGLang's generic get/set path (no interface_v1): flat pages via a staging buffer."""
    pool = pool_factory()
    extra = sh.umbp_extra(str(pool.socket_path), staging_pages=2)
    del extra["interface_v1"]
    ha, a = sh.host_pool("page_first"), None
    a = sh.make_backend(ha, extra)
    hb = sh.host_pool("page_first")
    b = sh.make_backend(hb, dict(extra))
    keys = sh.page_hashes(sh.tokens_of(41, 3))
    pages = [sh.expected_page(ha, 41, i) for i in range(3)]
    assert a.batch_set(keys, pages) is True
    assert b.exists(keys[0]) is False  # flat objects are not the zero-copy ones
    got = b.batch_get(keys, [hb.get_dummy_flat_data_page() for _ in keys])
    assert all(g is not None for g in got)
    assert all(torch.equal(g.view(torch.int16), p.view(torch.int16)) for g, p in zip(got, pages))
    assert b.get(sh.page_hashes(sh.tokens_of(42, 1))[0], hb.get_dummy_flat_data_page()) is None


def test_bad_options_are_refused_with_the_key(pool_factory) -> None:
    pool = pool_factory()
    hp = sh.host_pool("page_first")
    with pytest.raises(ValueError, match="unknown key.*'endpont'"):
        sh.make_backend(hp, {**sh.umbp_extra(str(pool.socket_path)), "endpont": "x"})
    with pytest.raises(ValueError, match="'timeout_ms' must be an integer"):
        sh.make_backend(hp, sh.umbp_extra(str(pool.socket_path), timeout_ms="soon"))
    with pytest.raises(RuntimeError, match="cannot reach the pool at '/nonexistent/umbp.sock'"):
        sh.make_backend(hp, sh.umbp_extra("/nonexistent/umbp.sock", startup_timeout_ms=200))


# -- SGLang's own HiCacheController drives the backend ------------------------------------
def test_controller_backup_in_one_process_prefetch_in_another(pool_factory) -> None:
    """SGLang's HiCacheController (real device pool, allocator, host pool, storage threads)
    loads our backend through `attach_storage_backend("dynamic", ...)`; one process backs up
    5 pages (write_storage -> backup thread -> batch_set_v1), another prefetches them
    (prefetch thread's batch_exists, io thread's batch_get_v1): all hit, byte-exact."""
    pool = pool_factory()
    w = _driver("ctl-store", str(pool.socket_path), "page_first", "51", "5")
    assert w["backend"] == "UMBPHiCacheStorage" and w["zero_copy"] is True
    assert w["completed_tokens"] == 5 * sh.PAGE
    r = _driver("ctl-load", str(pool.socket_path), "page_first", "51", "5")
    assert r["pid"] != w["pid"]
    assert r["hit_tokens"] == 5 * sh.PAGE and r["completed_tokens"] == 5 * sh.PAGE
    assert r["exact"] == [True] * 5
    m = _driver("ctl-load", str(pool.socket_path), "page_first", "52", "3")
    assert m["hit_tokens"] == 0 and m["completed_tokens"] == 0


def test_controller_with_dead_pool_misses_and_backs_up_nothing(pool_factory) -> None:
    """The pool dies under a running HiCacheController: its prefetch finds no hit and its
    backup completes no token; no exception reaches the controller's threads (they stay
    alive and serve the next operation once the pool is back)."""
    pool = pool_factory()
    hp = sh.host_pool("page_first")
    cc = sh.controller(hp, sh.umbp_extra(str(pool.socket_path), timeout_ms=500))
    try:
        toks = sh.tokens_of(61, 3)
        idx = hp.alloc(3 * hp.page_size)
        sh.fill_pages(hp, idx, 61)
        assert sh.controller_backup(cc, idx, toks) == 3 * sh.PAGE
        assert sh.controller_prefetch(cc, toks)[:2] == (3 * sh.PAGE, 3 * sh.PAGE)
        pool.kill()
        t0 = time.monotonic()
        assert sh.controller_prefetch(cc, toks) == (0, 0, None)
        assert sh.controller_backup(cc, idx, sh.tokens_of(62, 3)) == 0
        assert time.monotonic() - t0 < 15, "a dead pool must not stall the controller"
        assert cc.prefetch_thread.is_alive() and cc.backup_thread.is_alive()
        pool.start()
        deadline = time.monotonic() + 30
        done = 0
        while time.monotonic() < deadline and done == 0:
            done = sh.controller_backup(cc, idx, toks)
            time.sleep(0.2)
        assert done == 3 * sh.PAGE, "the controller's backend did not re-attach to the restarted pool"
        # The index re-attaches on a lookup once its backoff (at most 2 s) has passed.
        hit = got = 0
        while time.monotonic() < deadline + 10 and hit == 0:
            hit, got, dst = sh.controller_prefetch(cc, toks)
        assert (hit, got) == (3 * sh.PAGE, 3 * sh.PAGE)
        assert _exact(hp, idx, hp, dst, 3)
    finally:
        cc.detach_storage_backend()


# -- v2 (pool-aware) forms: KV plus Mamba and SWA host pools -------------------------------
def _hybrid(sock: str, side_state: bool = False, mamba_layers: int = 2):
    """A backend as SGLang's hybrid controller attaches it: KV anchor, then the extra pools
    through register_mem_host_pool_v2, then on_host_pools_registered."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    kv, swa, mamba = sh.host_pool("page_first"), sh.host_pool("page_first"), sh.mamba_pool(layers=mamba_layers, side_state=side_state)
    extra = sh.umbp_extra(sock)
    b = StorageBackendFactory.create_backend("dynamic", sh.storage_config(extra), kv)
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(swa, PoolName.SWA)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    b.on_host_pools_registered()
    return b, kv, swa, mamba


def _fill_flat(hp, idx, seed: int) -> None:
    ps = hp.page_size
    for i in range(0, idx.numel(), ps):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        page = hp.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, (page.numel() * page.element_size(),), generator=g, dtype=torch.int32)
        hp.set_from_flat_data_page(int(idx[i]), raw.to(torch.uint8).view(page.dtype))


def _flat(hp, idx) -> list[bytes]:
    ps = hp.page_size
    return [hp.get_data_page(int(idx[i]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
            for i in range(0, idx.numel(), ps)]


def test_v2_kv_swa_mamba_roundtrip_and_hit_policies(pool_factory) -> None:
    """batch_set_v2 / batch_exists_v2 / batch_get_v2 with real SGLang host pools: KV (4
    pages), SWA (the last 2 pages: TRAILING_PAGES), Mamba (one state slot for the last page:
    TRAILING_PAGES) stored by one backend, found and loaded byte-exact by another."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    pool = pool_factory()
    a, kva, swaa, ma = _hybrid(str(pool.socket_path))
    b, kvb, swab, mb = _hybrid(str(pool.socket_path))
    assert a.pools["mamba"].group != a.pools["swa"].group != a.pools["kv"].group
    keys = sh.page_hashes(sh.tokens_of(71, 4))
    ik, isw, im = kva.alloc(4 * sh.PAGE), swaa.alloc(2 * sh.PAGE), ma.alloc(1)
    sh.fill_pages(kva, ik, 71)
    _fill_flat(swaa, isw, 72)
    _fill_flat(ma, im, 73)
    res = a.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=ik, keys=keys),
                          PoolTransfer(PoolName.SWA, host_indices=isw, keys=keys[2:]),
                          PoolTransfer(PoolName.MAMBA, host_indices=im, keys=keys[3:])])
    assert res == {PoolName.KV: [True] * 4, PoolName.SWA: [True] * 2, PoolName.MAMBA: [True]}

    def query(ks, swa_keys, mamba_keys, swa_policy=PoolHitPolicy.TRAILING_PAGES):
        return b.batch_exists_v2(ks, [PoolTransfer(PoolName.SWA, keys=swa_keys, hit_policy=swa_policy),
                                      PoolTransfer(PoolName.MAMBA, keys=mamba_keys,
                                                   hit_policy=PoolHitPolicy.TRAILING_PAGES)])

    r = query(keys, keys[2:], keys[3:])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [4])
    assert r.extra_pool_hit_pages == {"kv": 4, "swa": 4, "mamba": 4}
    # A 3-page prefix has no Mamba state at its end: not restorable.
    r = query(keys[:3], keys[1:3], keys[2:3])
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])
    # ALL_PAGES for SWA: pages 0 and 1 have no SWA object, so no prefix qualifies.
    assert query(keys, keys, keys[3:], PoolHitPolicy.ALL_PAGES).kv_hit_pages == 0
    # Nothing of another request.
    assert query(sh.page_hashes(sh.tokens_of(74, 2)), [], []).kv_hit_pages == 0

    jk, jsw, jm = kvb.alloc(4 * sh.PAGE), swab.alloc(2 * sh.PAGE), mb.alloc(1)
    got = b.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=jk, keys=keys),
                          PoolTransfer(PoolName.SWA, host_indices=jsw, keys=keys[2:]),
                          PoolTransfer(PoolName.MAMBA, host_indices=jm, keys=keys[3:])])
    assert got == {PoolName.KV: [True] * 4, PoolName.SWA: [True] * 2, PoolName.MAMBA: [True]}
    assert _exact(kva, ik, kvb, jk, 4)
    assert _flat(swab, jsw) == _flat(swaa, isw)
    assert _flat(mb, jm) == _flat(ma, im)
    # A Mamba slot is not an SWA page: same hash, other pool, other object (a miss).
    assert b.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=mb.alloc(1), keys=keys[2:3])]) == \
        {PoolName.MAMBA: [False]}


def test_v2_pools_that_cannot_be_stored_are_refused_by_name(pool_factory) -> None:
    """A Mamba pool with registered side states has no zero-copy page description: the
    registration (hence SGLang's attach) fails naming the pool; a pool never registered is
    named by the v2 calls (exists raises; get/set report failure), nothing is stored."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    pool = pool_factory()
    with pytest.raises(ValueError, match="cannot store SGLang's mamba pool \\(MambaPoolHost\\)"):
        _hybrid(str(pool.socket_path), side_state=True)
    hp = sh.host_pool("page_first")
    b = sh.make_backend(hp, sh.umbp_extra(str(pool.socket_path)))
    keys = sh.page_hashes(sh.tokens_of(81, 2))
    idx = hp.alloc(2 * sh.PAGE)
    assert b.batch_set_v1(keys, idx) == [True, True]
    with pytest.raises(ValueError, match="indexer pool was never registered"):
        b.batch_exists_v2(keys, [PoolTransfer(PoolName.INDEXER, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert b.batch_set_v2([PoolTransfer(PoolName.INDEXER, host_indices=idx, keys=keys)]) == \
        {PoolName.INDEXER: [False, False]}
    r = b.batch_exists_v2(keys)  # KV only: still the plain prefix
    assert (r.kv_hit_pages, r.restorable_prefix_pages) == (2, [1, 2])


def test_hybrid_controller_kv_and_mamba_state_across_processes(pool_factory) -> None:
    """SGLang's HybridCacheController (the Mamba-hybrid path) with a KV + Mamba host pool
    group: one process backs up 4 KV pages and the Mamba state of the last page
    (batch_set_v2 + batch_set_v1); another prefetches (batch_exists_v2 with TRAILING_PAGES,
    batch_get_v1, batch_get_v2): KV and Mamba hits, byte-exact KV pages and state. A
    3-page prefix of the same tokens has no Mamba state at its end: no hit at all."""
    pool = pool_factory()
    s = str(pool.socket_path)
    w = _driver("hyb-store", s, "page_first", "91", "4")
    assert w["pools"] == ["kv", "mamba"] and w["completed_tokens"] == 4 * sh.PAGE
    r = _driver("hyb-load", s, "page_first", "91", "4")
    assert r["pid"] != w["pid"]
    assert r["hit_tokens"] == 4 * sh.PAGE and r["pool_hits"] == {"kv": 4, "mamba": 4}
    assert r["completed_tokens"] == 4 * sh.PAGE and r["exact"] == [True] * 4
    assert r["mamba_pages"] == 1 and r["mamba_exact"] is True
    m = _driver("hyb-load", s, "page_first", "91", "3")
    assert m["hit_tokens"] == 0 and m["completed_tokens"] == 0


def test_v2_extra_pools_of_other_shapes_share_nothing(pool_factory) -> None:
    """Two deployments with the same KV namespace but Mamba states of different shapes (2
    vs 3 layers): the KV pages are shared, the Mamba objects are not (a state of the wrong
    shape is never loaded into a slot)."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

    pool = pool_factory()
    a, kva, _, ma = _hybrid(str(pool.socket_path))
    b, kvb, _, mb = _hybrid(str(pool.socket_path), mamba_layers=3)
    assert a.namespace == b.namespace and a.pools["mamba"].salt != b.pools["mamba"].salt
    keys = sh.page_hashes(sh.tokens_of(95, 2))
    ik, im = kva.alloc(2 * sh.PAGE), ma.alloc(1)
    sh.fill_pages(kva, ik, 95)
    _fill_flat(ma, im, 96)
    assert a.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=ik, keys=keys),
                           PoolTransfer(PoolName.MAMBA, host_indices=im, keys=keys[1:])]) == \
        {PoolName.KV: [True, True], PoolName.MAMBA: [True]}
    mamba_q = [PoolTransfer(PoolName.MAMBA, keys=keys[1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    assert a.batch_exists_v2(keys, mamba_q).kv_hit_pages == 2
    r = b.batch_exists_v2(keys, mamba_q)
    assert b.batch_exists(keys) == 2 and r.kv_hit_pages == 0 and "mamba" not in r.extra_pool_hit_pages
    assert b.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=mb.alloc(1), keys=keys[1:])]) == \
        {PoolName.MAMBA: [False]}
