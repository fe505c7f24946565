"""Replicated KV stored once (issue #36): against vLLM's real `Scheduler` with one
worker-role connector per TP rank (sched_harness.py `tp=N`), the real binding and a real
standalone `umbp-pool`.

- MLA at TP4: every rank holds the same latent; the pool holds one object per block (a
  quarter of what per-rank keys store), every rank restores it byte-exact.
- GQA with 2 KV heads at TP4 (vLLM gives each head to two ranks): each head is stored once
  (2 objects per block, not 4); every rank restores its own head's bytes (the harness writes
  each head's bytes apart, so a rank that loaded the other head's object is caught).
- BlockStored is published once the one copy of a block is in the pool.
- `store_replicas_once=false`, embedded mode, DCP and Mamba keep one copy per rank.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from conftest import harness_factory

pytestmark = pytest.mark.timeout(300)

BLOCK = 128


@pytest.fixture
def make_standalone(cfg_dir, native, monkeypatch):
    # A TP rank's share of the tiny model is one KV head: 32 KiB objects, below the pool's
    # default smallest object; the pools started by pool_factory read this.
    monkeypatch.setenv("UMBP_MIN_OBJECT_SIZE", "16KiB")
    yield from harness_factory(cfg_dir, {"mode": "standalone", "key_namespace": "replicas"})


@pytest.fixture
def make(cfg_dir, native):
    yield from harness_factory(cfg_dir, {"capacity_bytes": "16MiB", "key_namespace": "replicas"})


def T(seed, n=300):
    from sched_harness import tokens

    return tokens(seed, n)


# -- the plan ------------------------------------------------------------------------------


def _config(tp=4, heads=2, dcp=1, pcp=1):
    pc = SimpleNamespace(tensor_parallel_size=tp, prefill_context_parallel_size=pcp, decode_context_parallel_size=dcp)
    mc = SimpleNamespace(get_total_num_kv_heads=lambda: heads)
    return SimpleNamespace(parallel_config=pc, model_config=mc)


def _kcc(*specs):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def _specs():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    return full, mla


def test_the_plan_follows_vllm_replication():
    from umbp.vllm.replicas import replica_plan

    full, mla = _specs()
    on = dict(enabled=True, standalone=True)
    # MLA: one latent for every TP rank -> one key rank per PCP rank.
    p = replica_plan(_config(tp=8, heads=1), _kcc(mla), ["full"], **on)
    assert (p.replicas, p.key_ranks) == (8, 1) and "MLA" in p.why
    assert [p.key_rank(r) for r in range(8)] == [0] * 8
    # 2 KV heads at TP4: ranks 0,1 hold head 0 and ranks 2,3 head 1 (vLLM's r // replicas).
    p = replica_plan(_config(tp=4, heads=2), _kcc(full), ["full"], **on)
    assert (p.replicas, p.key_ranks) == (2, 2)
    assert [p.key_rank(r) for r in range(4)] == [0, 0, 1, 1]
    # With PCP the replica groups repeat per PCP rank.
    p = replica_plan(_config(tp=4, heads=2, pcp=2), _kcc(full), ["full"], **on)
    assert p.key_ranks == 4 and [p.key_rank(r, 1) for r in range(4)] == [2, 2, 3, 3]
    # Enough heads for every rank: nothing replicated, keys as before (key rank = TP rank).
    p = replica_plan(_config(tp=2, heads=2), _kcc(full), ["full"], **on)
    assert (p.replicas, p.key_ranks) == (1, 2) and [p.key_rank(r) for r in range(2)] == [0, 1]
    assert p.namespace_suffix() == ""
    # Off, each with its reason.
    for cfg, kinds, kw, why in [
        (_config(tp=8, heads=1), ["full"], dict(enabled=False, standalone=True), "store_replicas_once"),
        (_config(tp=8, heads=1), ["full"], dict(enabled=True, standalone=False), "embedded"),
        (_config(tp=8, heads=1, dcp=2), ["full"], on, "decode_context_parallel"),
        (_config(tp=8, heads=1), ["full", "mamba"], on, "Mamba"),
        (_config(tp=1, heads=1), ["full"], on, "one TP rank"),
    ]:
        p = replica_plan(cfg, _kcc(mla), kinds, **kw)
        assert p.replicas == 1 and why in p.why, (why, p)
    # Groups that replicate differently (MLA beside 2-head attention at TP4): off.
    p = replica_plan(_config(tp=4, heads=2), _kcc(mla, full), ["full", "full"], **on)
    assert p.replicas == 1 and "differently" in p.why


def test_exactly_one_rank_of_a_group_stores_each_block_and_the_blocks_spread():
    from umbp.vllm.replicas import ReplicaPlan

    p = ReplicaPlan(tp_size=8, pcp_size=1, replicas=4, why="test")
    keys = [os.urandom(16) for _ in range(4000)]
    for group in range(2):
        ranks = range(group * 4, group * 4 + 4)
        per_rank = {r: sum(p.stores(r, k) for k in keys) for r in ranks}
        for k in keys[:200]:
            assert sum(p.stores(r, k) for r in ranks) == 1
        # Uniform keys: each rank stores about a quarter (1000 +- 5 sigma).
        assert all(850 < n < 1150 for n in per_rank.values()), per_rank
    with pytest.raises(ValueError):
        ReplicaPlan(tp_size=4, pcp_size=1, replicas=3, why="x")


# -- against vLLM's scheduler and a real pool ----------------------------------------------


def _restore_everywhere(h, seed):
    """Run a prompt, forget it locally, then restore it from the pool: returns the second
    request and its block ids."""
    h.add("a", T(seed))
    h.run()
    h.reset_local_cache()
    b = h.request("b", T(seed))
    assert h.conn.get_num_new_matched_tokens(b, 0) == (2 * BLOCK, True)
    h.sched.add_request(b)
    h.step()
    ids = h.block_ids("b")
    h.run()
    assert h.external_tokens("b") == 2 * BLOCK
    return b, ids


def test_mla_at_tp4_stores_one_object_per_block_and_every_rank_restores_it(make_standalone, pool_factory):
    pool = pool_factory("mla-tp4")
    h = make_standalone(tp=4, mla=True, events=True, extra={"endpoint": str(pool.socket_path)})
    assert (h.conn._replicas.replicas, h.conn._key_ranks) == (4, 1)
    b, ids = _restore_everywhere(h, 11)
    # Two full blocks, one object each (per-rank keys stored 8).
    assert pool.report()["pool"]["objects"] == 2
    for r in range(4):
        assert h.holds_blocks_of(b, ids, 2, rank=r), f"TP rank {r}"
    stats = h.connector_stats()
    assert stats["store_replica_skipped_blocks"] == 2 * 3  # each block skipped by 3 of 4 ranks
    # BlockStored for both blocks of the first run, published on the one copy.
    # (With a count of every TP rank's confirmation, as before, they would never be.)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    stored = [x for e in h.recorder.take() if type(e).__name__ == "BlockStored" for x in e.block_hashes]
    assert sorted(map(str, stored)) == sorted(str(maybe_convert_block_hash(bytes(x))) for x in b.block_hashes[:2])


def test_mla_with_replicas_off_stores_a_copy_per_rank(make_standalone, pool_factory):
    pool = pool_factory("mla-tp4-off")
    h = make_standalone(tp=4, mla=True, extra={"endpoint": str(pool.socket_path), "store_replicas_once": False})
    assert (h.conn._replicas.replicas, h.conn._key_ranks) == (1, 4)
    b, ids = _restore_everywhere(h, 12)
    assert pool.report()["pool"]["objects"] == 8
    assert all(h.holds_blocks_of(b, ids, 2, rank=r) for r in range(4))


def test_gqa_two_heads_at_tp4_stores_each_head_once(make_standalone, pool_factory):
    pool = pool_factory("gqa-tp4")
    h = make_standalone(tp=4, extra={"endpoint": str(pool.socket_path)})
    assert (h.conn._replicas.replicas, h.conn._key_ranks) == (2, 2)
    b, ids = _restore_everywhere(h, 13)
    # Two blocks x two heads (per-rank keys stored two blocks x four ranks).
    assert pool.report()["pool"]["objects"] == 4
    # Each rank holds its own head's bytes (ranks 2 and 3 hold head 1, written apart).
    assert h.shard_offset(0) == h.shard_offset(1) != h.shard_offset(2) == h.shard_offset(3)
    for r in range(4):
        assert h.holds_blocks_of(b, ids, 2, rank=r), f"TP rank {r}"


def test_a_hit_needs_every_replica_groups_copy(make_standalone, pool_factory, native):
    from umbp.vllm.keys import make_keys

    pool = pool_factory("gqa-tp4-hit")
    h = make_standalone(tp=4, extra={"endpoint": str(pool.socket_path)})
    a = h.add("a", T(14))
    h.run()
    h.reset_local_cache()
    ns, g = h.conn._sched.namespace, h.conn._group
    hashes = [bytes(x) for x in a.block_hashes[:2]]
    idx = h.conn._sched._indexes[0]
    # Both key ranks' objects are there, and no object under a per-TP-rank key 2 or 3.
    for r in range(2):
        assert all(idx.contains(k) for k in make_keys(native, ns, g, r, hashes))
    for r in range(2, 4):
        assert not any(idx.contains(k) for k in make_keys(native, ns, g, r, hashes))
    # Head 1's copies gone (the ranks of group 1 drop what they stored): no longer a hit.
    assert h.workers[2]._worker.w.reset_namespace() + h.workers[3]._worker.w.reset_namespace() >= 2
    assert h.conn.get_num_new_matched_tokens(h.request("c", T(14)), 0) == (0, False)


def test_embedded_tp_ranks_keep_a_copy_each(make):
    h = make(tp=2, mla=True)
    assert h.conn._replicas.replicas == 1 and "embedded" in h.conn._replicas.why
    assert h.conn._key_ranks == 2


def test_the_replicated_plan_has_its_own_namespace(make_standalone, pool_factory):
    pool = pool_factory("mla-ns")
    on = make_standalone(tp=2, mla=True, extra={"endpoint": str(pool.socket_path)})
    off = make_standalone(
        tp=2, mla=True, extra={"endpoint": str(pool.socket_path), "store_replicas_once": False}
    )
    # Same user key_namespace, different plans: keys must never meet (key rank 1 names a
    # replica group in one and TP rank 1 in the other).
    assert on.conn._base_namespace != off.conn._base_namespace
    assert on.conn._ns_text.endswith("|kv-replicas=2")


def test_the_option_is_a_checked_bool():
    from umbp.vllm.config import UMBPConnectorConfig

    assert UMBPConnectorConfig.from_extra_config({}, None).store_replicas_once is True
    assert UMBPConnectorConfig.from_extra_config({"store_replicas_once": "false"}, None).store_replicas_once is False
    with pytest.raises(ValueError, match="store_replicas_once"):
        UMBPConnectorConfig.from_extra_config({"store_replicas_once": "maybe"}, None)
