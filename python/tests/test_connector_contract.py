"""UMBPStoreConnector against a real vLLM `Scheduler` (sched_harness.py): the scheduler
side hooks as vLLM calls them, a worker-role connector on real CPU KV tensors, and the
real binding with an embedded pool. No model runs; a fake forward marks each computed
block with a value derived from its hash, so restored bytes can be checked exactly.

Covered: get_num_new_matched_tokens (side-effect free, repeatable, capped),
update_state_after_alloc + build_connector_meta (the load/store plan), request_finished
delaying frees while stores are unconfirmed, get_finished, load errors with
kv_load_failure_policy=recompute, take_events (BlockStored, and BlockRemoved for pool
evictions and reset_cache), get_kv_connector_stats, kv_role, pipeline parallelism.
"""

from __future__ import annotations

import time

import pytest

from conftest import harness_factory

pytestmark = pytest.mark.timeout(300)

BLOCK = 128


@pytest.fixture
def make(cfg_dir, native):
    yield from harness_factory(cfg_dir, {"capacity_bytes": "16MiB", "key_namespace": "contract"})


def T(seed, n=300):
    from sched_harness import tokens

    return tokens(seed, n)


def meta_ops(so, kind):
    return getattr(so.kv_connector_metadata, kind)


# -- lookups ---------------------------------------------------------------------------


def test_lookup_is_repeatable_and_side_effect_free(make):
    h = make()
    h.store_and_forget("a", T(1))
    report = h.pool_report()["pool"]
    b = h.request("b", T(1))
    # Two full blocks in the pool; repeated calls give the same answer.
    assert [h.conn.get_num_new_matched_tokens(b, 0) for _ in range(3)] == [(256, True)] * 3
    assert h.conn.get_num_new_matched_tokens(b, BLOCK) == (BLOCK, True)  # beyond a local hit
    assert h.conn.get_num_new_matched_tokens(b, 256) == (0, False)
    assert h.conn.get_num_new_matched_tokens(h.request("x", T(99)), 0) == (0, False)
    # Nothing was planned or moved by those lookups.
    so = h.step()
    assert meta_ops(so, "loads") == [] and meta_ops(so, "stores") == []
    after = h.pool_report()["pool"]
    assert (after["objects"], after["allocated_bytes"]) == (report["objects"], report["allocated_bytes"])


def test_hit_covering_the_whole_prompt_leaves_one_token(make):
    h = make()
    h.store_and_forget("a", T(2, 256))
    assert h.conn.get_num_new_matched_tokens(h.request("b", T(2, 256)), 0) == (255, True)


# -- loads -----------------------------------------------------------------------------


@pytest.mark.parametrize("load_async", [True, False], ids=["async", "sync"])
def test_load_plan_and_restored_bytes(make, load_async):
    # Synchronous loads only under "fail" (under "recompute" loads are always async).
    h = make(extra={"load_async": load_async}, failure_policy="recompute" if load_async else "fail")
    h.store_and_forget("a", T(3))
    b = h.add("b", T(3), max_tokens=2)
    so = h.step()
    (op,) = meta_ops(so, "loads")
    hashes = [bytes(x) for x in b.block_hashes]
    assert (op.req_id, op.hashes, op.is_async) == ("b", hashes[:2], load_async)
    assert op.block_ids == h.block_ids("b")[:2]
    if load_async:
        assert not so.num_scheduled_tokens  # waits for the load, no forward
        assert str(h.sched.requests["b"].status).endswith("WAITING_FOR_REMOTE_KVS")
    else:
        assert so.num_scheduled_tokens == {"b": 300 - 256}
    h.step_until(lambda: h.sched.requests["b"].num_computed_tokens > 256)  # forwarded past the hit
    # The blocks hold exactly what was stored for their hashes (the buffer was zeroed).
    assert h.holds_blocks_of(b, h.block_ids("b"), 2)
    h.run()
    assert h.external_tokens("b") == 256
    assert "b" in h.finished_returns


def test_recompute_policy_forces_async_loads(make):
    """Issue #31 item 4: under kv_load_failure_policy "recompute" vLLM recomputes a failed
    synchronous load into the same blocks, which a started load of a stalled pool may
    still write, so a synchronous load could only be waited for (holding the step). The
    connector loads asynchronously there: load_async=false is ignored."""
    h = make(extra={"load_async": False})
    assert h.conn._load_async and h.conn._force_async
    h.store_and_forget("a", T(3))
    h.add("b", T(3), max_tokens=2)
    (op,) = meta_ops(h.step(), "loads")
    assert op.is_async, "a synchronous load was planned under recompute"


def test_load_failure_recomputes(make, native):
    h = make(extra={"load_async": True})
    h.store_and_forget("a", T(4))
    b = h.add("b", T(4), max_tokens=2)

    def drop_objects(so):
        # Between the lookup and the load: the index said "hit", the objects are gone.
        w = native.Worker(h.worker._worker.endpoint, native.namespace_digest("contract"))
        assert w.reset_namespace() == 2
        w.close()

    so = h.step(before_worker=drop_objects)
    assert len(meta_ops(so, "loads")) == 1
    h.run(timeout=20)  # finishes: no endless retry of the failed load
    assert "b" in h.finished_returns
    s = h.connector_stats()
    assert s["load_failed_blocks"] == 2 and s["loaded_blocks"] == 0
    # The request recomputed its prompt and stored it again.
    assert h.pool_report()["pool"]["published_objects"] == 2
    assert b.num_computed_tokens >= 300


# -- request lifetime --------------------------------------------------------------------


def test_request_finished_delays_free_while_stores_pending(make):
    h = make()
    free0 = h.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    h.add("a", T(5), max_tokens=1)
    so1 = h.step()
    assert [op.req_id for op in meta_ops(so1, "stores")] == ["a"]
    # It finished in the step whose store no worker has confirmed yet: blocks stay.
    assert h.finished_returns["a"] == (True, None)
    assert "a" in h.sched.requests
    assert h.sched.kv_cache_manager.block_pool.get_num_free_blocks() < free0
    so2 = h.step()
    assert so2.kv_connector_metadata.finish_after_stores == ["a"]
    # Freed once every worker reported it in get_finished (when its store completed).
    h.step_until(lambda: "a" not in h.sched.requests)
    assert h.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0

    # A request whose stores were confirmed before it finished is freed at once.
    h.add("b", T(6), max_tokens=3)
    h.step()  # prefill: the store is submitted
    time.sleep(0.2)  # the pool completes it (~1 ms); the next step reports it
    h.run()
    assert h.finished_returns["b"] == (False, None)
    assert "b" not in h.sched.requests


# -- events and stats --------------------------------------------------------------------


def test_events_and_stats(make):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    h = make(events=True)
    toks = T(7)
    a = h.add("a", toks)
    h.run()
    stored = h.recorder.take()
    hashes = [bytes(x) for x in a.block_hashes]
    assert [type(e).__name__ for e in stored] == ["BlockStored"] * 2
    assert [e.block_hashes for e in stored] == [[maybe_convert_block_hash(x)] for x in hashes]
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == maybe_convert_block_hash(hashes[0])
    assert stored[1].token_ids == toks[BLOCK : 2 * BLOCK] and stored[0].block_size == BLOCK
    s = h.connector_stats()
    obj = h.worker._worker.object_bytes
    assert (s["lookups"], s["hit_tokens"], s["miss_tokens"]) == (1, 0, 300)
    assert (s["stored_blocks"], s["stored_bytes"]) == (2, 2 * obj) and s["store_GBps"] > 0

    h.reset_local_cache()
    h.add("b", toks)
    h.run()
    s = h.connector_stats()
    assert (s["lookups"], s["hit_tokens"], s["miss_tokens"], s["hit_rate"]) == (1, 256, 44, round(256 / 300, 4))
    assert (s["loaded_blocks"], s["loaded_bytes"]) == (2, 2 * obj) and s["load_GBps"] > 0
    assert h.recorder.take() == []  # nothing new stored (the pool had both blocks)


def test_pool_evictions_become_block_removed_events(make):
    # 4 MiB pool = 64 objects of 64 KiB; 20 prompts of 4 blocks overflow it.
    h = make(events=True, extra={"capacity_bytes": "4MiB"})
    reqs = [h.add(f"r{i}", T(100 + i, 4 * BLOCK + 10)) for i in range(20)]
    h.run(timeout=60)
    deadline = time.monotonic() + 10
    stored, removed = set(), set()
    while time.monotonic() < deadline:
        for e in h.recorder.take():
            (stored if type(e).__name__ == "BlockStored" else removed).add(e.block_hashes[0])
        evictions = h.pool_report()["pool"]["evictions"]
        if evictions and len(removed) >= evictions:
            break
        h.step()  # an idle step: vLLM still collects events
        time.sleep(0.05)
    assert evictions > 0, "the pool never evicted"
    assert len(removed) == evictions and removed <= stored
    # The first prompt went first (LRU): no longer a hit.
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    assert maybe_convert_block_hash(bytes(reqs[0].block_hashes[0])) in removed
    assert h.conn.get_num_new_matched_tokens(h.request("again", T(100, 4 * BLOCK + 10)), 0) == (0, False)


def test_reset_cache_drops_the_pooled_objects(make):
    h = make(events=True)
    h.add("a", T(8))
    h.run()
    assert len(h.recorder.take()) == 2
    assert h.pool_report()["pool"]["published_objects"] == 2
    assert h.sched.reset_prefix_cache(reset_connector=True)
    so = h.step()  # the next step tells the workers
    assert so.kv_connector_metadata.reset_pool
    assert h.pool_report()["pool"]["published_objects"] == 0
    h.step()
    assert [type(e).__name__ for e in h.recorder.take()] == ["BlockRemoved"] * 2
    assert h.conn.get_num_new_matched_tokens(h.request("b", T(8)), 0) == (0, False)
    # The engine keeps working: new stores, new hits.
    h.kv_buffer.zero_()
    h.store_and_forget("c", T(8))
    h.add("d", T(8))
    h.run()
    assert h.external_tokens("d") == 256


# -- roles and topology ------------------------------------------------------------------


def test_kv_consumer_only_loads(make):
    h = make(kv_role="kv_consumer")
    h.add("a", T(9))
    while h.sched.has_requests():
        assert meta_ops(h.step(), "stores") == []
    assert h.pool_report()["pool"]["objects"] == 0
    s = h.connector_stats()
    assert s["lookups"] == 1 and s["stored_blocks"] == 0


def test_kv_producer_never_loads(make):
    h = make(kv_role="kv_producer")
    h.add("a", T(10))
    h.run()
    assert h.pool_report()["pool"]["published_objects"] == 2
    h.reset_local_cache()
    assert h.conn.get_num_new_matched_tokens(h.request("b", T(10)), 0) == (0, False)


def test_pipeline_parallel_is_refused(make):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from umbp.vllm import UMBPStoreConnector

    h = make()
    pc = h.vllm_config.parallel_config
    pc.pipeline_parallel_size = 2
    try:
        with pytest.raises(ValueError, match="pipeline_parallel_size"):
            UMBPStoreConnector(h.vllm_config, KVConnectorRole.WORKER, h.kv_cache_config)
    finally:
        pc.pipeline_parallel_size = 1


# -- lazy offload ------------------------------------------------------------------------


def test_lazy_offload_keeps_a_block_evicted_right_after_its_free(make):
    """Issue #33 item 9: vLLM frees a finished request's blocks (last block first) after the
    step's metadata was built, and the next schedule() may evict them before the next
    metadata's free-queue scan: the prompt's tail block was never stored. The connector
    scans again right after the frees (update_connector_output)."""
    # 9 blocks, one the null block (the least for max_model_len 1024): a 3-block prompt
    # (+1 partial), and a 7-block one whose first schedule() takes the 4 unused blocks and
    # then the first prompt's freed ones, tail first.
    h = make(num_blocks=9, extra={"lazy_offload": True})
    # Derived from max_num_batched_tokens: covers the whole free queue here.
    assert h.conn._offload.lazy_offload_max_blocks >= h.num_blocks
    a_toks = T(21, 3 * BLOCK + 6)
    h.add("a", a_toks)
    # Waits (7 blocks do not fit next to a's 4) and is allocated in the schedule() right
    # after a's blocks were freed, before that step's metadata is built.
    h.add("b", T(22, 7 * BLOCK - 10))
    h.run()
    assert h.external_tokens("b") == 0
    h.reset_local_cache()
    h.add("a2", a_toks)
    h.run()
    assert h.external_tokens("a2") == 3 * BLOCK, "a block of the evicted prompt was never stored"


def test_lazy_offload_max_blocks_follows_max_num_batched_tokens(cfg_dir):
    from umbp.vllm.config import OffloadOptions

    derived = OffloadOptions.from_extra_config({"lazy_offload": True}).derive_max_blocks(8192, 16)
    assert derived.lazy_offload_max_blocks == 512
    assert OffloadOptions().derive_max_blocks(2049, 128).lazy_offload_max_blocks == 17
    # Set in the config: kept.
    kept = OffloadOptions.from_extra_config({"lazy_offload_max_blocks": 8}).derive_max_blocks(8192, 16)
    assert kept.lazy_offload_max_blocks == 8


def test_lazy_offload_announces_what_it_stores(make):
    """Issue #33 item 5: with lazy_offload=true, blocks stored from the free queue are
    announced (BlockStored, with their parent and tokens) like eager stores."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    # A small cache (as in the test above): b's allocation evicts a's blocks, which lazy
    # offload therefore stores (a's last, partial block is never cached).
    h = make(num_blocks=9, events=True, extra={"lazy_offload": True})
    toks = T(31, 3 * BLOCK + 6)
    a = h.add("a", toks)
    h.add("b", T(32, 7 * BLOCK - 10))
    h.run()
    hashes = [bytes(x) for x in a.block_hashes][:3]
    assert h.conn._sched.lazy_stored_blocks >= 3
    stored = [e for e in h.recorder.take() if type(e).__name__ == "BlockStored"]
    by_hash = {e.block_hashes[0]: e for e in stored}
    assert all(maybe_convert_block_hash(x) in by_hash for x in hashes), stored
    for b, x in enumerate(hashes):
        e = by_hash[maybe_convert_block_hash(x)]
        assert e.token_ids == toks[b * BLOCK : (b + 1) * BLOCK] and e.block_size == BLOCK
        assert e.parent_block_hash == (maybe_convert_block_hash(hashes[b - 1]) if b else None)
