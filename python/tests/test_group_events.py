"""KV events for every KV cache group, and for blocks an engine finds in a shared pool
(issue #33 item 5), against vLLM's real Scheduler and KV cache manager (sched_harness.py,
hybrid_harness.py: no model runs).

- A sliding-window hybrid (full attention + sliding window) and a Mamba hybrid (full
  attention + Mamba2 state, mamba_cache_mode='align') announce the blocks of every group
  they store: `BlockStored` with the group's `group_idx`, `kv_cache_spec_kind` and
  `kv_cache_spec_sliding_window`; `BlockRemoved` with the group when the pool drops them.
- Two engines on one `umbp-pool` process: a block engine A stored is announced by engine B
  (medium of its pool tier) as soon as B's lookup finds it, once; B announces its removal
  when the pool drops it.
"""

from __future__ import annotations

import time

import pytest

from conftest import harness_factory
from sched_harness import config_only_model_dir, tokens as T

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def granite(vllm_ok) -> str:
    from tiny_hybrid import build_tiny_hybrid

    return config_only_model_dir(build_tiny_hybrid("granite_hybrid"))


@pytest.fixture(scope="module")
def gemma2(vllm_ok) -> str:
    from tiny_hybrid import build_tiny_hybrid

    return config_only_model_dir(build_tiny_hybrid("gemma2"))


@pytest.fixture
def make_mamba(granite, native):
    from hybrid_harness import HybridHarness

    yield from harness_factory(granite, {"capacity_bytes": "16MiB", "key_namespace": "mamba-events"},
                               harness=HybridHarness)


@pytest.fixture
def make_sliding(gemma2, native):
    from hybrid_harness import HybridHarness

    yield from harness_factory(gemma2, {"capacity_bytes": "16MiB", "key_namespace": "sliding-events"},
                               harness=HybridHarness)


@pytest.fixture
def make(cfg_dir, native):
    yield from harness_factory(cfg_dir)


def conv(h) -> object:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(bytes(h))


def split(events: list) -> tuple[list, list]:
    stored = [e for e in events if type(e).__name__ == "BlockStored"]
    removed = [e for e in events if type(e).__name__ == "BlockRemoved"]
    return stored, removed


def by_group(stored: list) -> dict[int, dict[object, object]]:
    out: dict[int, dict[object, object]] = {}
    for e in stored:
        assert len(e.block_hashes) == 1, e
        out.setdefault(e.group_idx, {})[e.block_hashes[0]] = e
    return out


def settle(h) -> None:
    """Idle steps until the pinned stores (sliding-window, Mamba) are confirmed; their
    events are published with the workers' reports."""
    h.step_until(lambda: not h.conn._sched._pins and not h.conn._sched._event_pending)
    h.step()


def removed_after_reset(h, want: set, timeout: float = 10.0) -> set:
    """reset_cache drops the engine's objects from the pool: the BlockRemoved events
    (group, hash) seen until `want` all came (or the timeout)."""
    assert h.sched.reset_prefix_cache(reset_connector=True)
    seen: set = set()
    deadline = time.monotonic() + timeout
    while not want <= seen and time.monotonic() < deadline:
        h.step()
        _, removed = split(h.recorder.take())
        seen |= {(e.group_idx, e.block_hashes[0]) for e in removed}
        time.sleep(0.02)
    return seen


def test_sliding_window_group_blocks_are_announced(make_sliding):
    h = make_sliding(events=True, kind="sliding")
    assert sorted(g.kind for g in h.conn._groups) == ["full", "sliding"]
    bs = h.block
    assert h.hash_block == bs
    prompt = T(5, 3 * bs + 44)
    a = h.add("a", prompt)
    h.run()
    settle(h)
    stored, removed = split(h.recorder.take())
    assert removed == []
    groups = by_group(stored)
    full, sw = h.gid("attn"), h.gid("sliding")
    hashes = [bytes(x) for x in a.block_hashes][:3]
    # The full-attention group: every full block, as before.
    assert set(groups.get(full, {})) == {conv(x) for x in hashes}
    # The sliding-window group: exactly the blocks the pool holds for it, each with the
    # window, its tokens and its parent, medium CPU.
    in_pool = [i for i in range(3) if h.conn._sched._present(sw, hashes[i])]
    assert in_pool, "no sliding-window block reached the pool"
    assert set(groups.get(sw, {})) == {conv(hashes[i]) for i in in_pool}, stored
    for i in in_pool:
        e = groups[sw][conv(hashes[i])]
        assert e.kv_cache_spec_kind == "sliding_window" and e.kv_cache_spec_sliding_window == 128
        assert e.token_ids == prompt[i * bs : (i + 1) * bs] and e.block_size == bs
        assert e.parent_block_hash == (conv(hashes[i - 1]) if i else None)
        assert e.medium == "CPU"
    for e in groups[full].values():
        assert e.kv_cache_spec_kind == "full_attention" and e.kv_cache_spec_sliding_window is None
    assert len(stored) == len(groups[full]) + len(groups[sw]), "a block was announced twice"
    # The same prompt again (vLLM's cache emptied): loaded, nothing announced again.
    h.reset_local_cache()
    h.add("b", prompt)
    h.run()
    settle(h)
    assert h.external_tokens("b") > 0
    assert split(h.recorder.take())[0] == []
    # Dropped from the pool: BlockRemoved for every announced block of both groups.
    want = {(e.group_idx, e.block_hashes[0]) for e in stored}
    assert removed_after_reset(h, want) == want


def test_mamba_group_states_are_announced(make_mamba):
    h = make_mamba(events=True)
    bs, hb = h.block, h.hash_block
    prompt = T(6, 3 * bs + 44)
    a = h.add("a", prompt, max_tokens=2)
    h.run()
    settle(h)
    stored, removed = split(h.recorder.take())
    assert removed == []
    groups = by_group(stored)
    full, mg = h.gid("attn"), h.gid("mamba")
    hashes = [bytes(x) for x in a.block_hashes]
    assert set(groups.get(full, {})) == {conv(x) for x in hashes[: 3 * bs // hb]}
    # Every state vLLM handed off (and the connector stored) is announced like vLLM
    # announces a partial entry: the hash of the prefix ending at the boundary, the
    # tokens of its last hash block, its parent.
    boundaries = sorted({bd for rid, gid, _, bd in h.handoffs if rid == "a" and gid == mg})
    assert boundaries, "vLLM handed off no Mamba state"
    assert all(h.conn._sched._present(mg, hashes[bd // hb - 1]) for bd in boundaries)
    assert set(groups.get(mg, {})) == {conv(hashes[bd // hb - 1]) for bd in boundaries}, stored
    for bd in boundaries:
        k = bd // hb
        e = groups[mg][conv(hashes[k - 1])]
        assert e.kv_cache_spec_kind == "mamba" and e.kv_cache_spec_sliding_window is None
        assert e.token_ids == prompt[bd - hb : bd] and e.block_size == hb
        assert e.parent_block_hash == (conv(hashes[k - 2]) if k > 1 else None)
        assert e.medium == "CPU"
    assert all(e.kv_cache_spec_kind == "full_attention" for e in groups[full].values())
    assert len(stored) == len(groups[full]) + len(groups[mg]), "a block was announced twice"
    want = {(e.group_idx, e.block_hashes[0]) for e in stored}
    assert removed_after_reset(h, want) == want


def test_blocks_another_engine_stored_are_announced_once_by_the_engine_that_finds_them(make, pool_factory):
    """Engines A and B of one model share a standalone pool. B never stored the prompt A
    stored; its lookup finds it, so B can serve it: B announces it (BlockStored, medium
    CPU for the pool's DRAM) right away, once, and BlockRemoved when the pool drops it."""
    pool = pool_factory("events-ab")
    extra = {"mode": "standalone", "endpoint": str(pool.socket_path), "key_namespace": "events-ab"}
    a = make(events=True, extra=extra)
    b = make(events=True, extra=extra)
    bs = 128
    toks = T(40, 2 * bs + 44)
    ra = a.add("a", toks)
    a.run()
    a_stored, _ = split(a.recorder.take())
    hashes = [bytes(x) for x in ra.block_hashes][:2]
    assert [e.block_hashes[0] for e in a_stored] == [conv(x) for x in hashes]
    b.step()
    assert b.recorder.take() == [], "B announced something it neither stored nor found"

    rb = b.add("b1", toks)
    b.step()  # B's scheduler looks the prompt up (a hit on A's blocks) and publishes
    stored, removed = split(b.recorder.take())
    assert removed == []
    assert [e.block_hashes[0] for e in stored] == [conv(x) for x in hashes], stored
    for i, e in enumerate(stored):
        assert e.medium == "CPU" and e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention"
        assert e.token_ids == toks[i * bs : (i + 1) * bs] and e.block_size == bs
        assert e.parent_block_hash == (conv(hashes[i - 1]) if i else None)
    b.run()
    assert b.external_tokens("b1") == 2 * bs
    # Found again (another request, vLLM's own cache emptied): not announced twice.
    b.reset_local_cache()
    b.add("b2", toks)
    b.run()
    assert b.external_tokens("b2") == 2 * bs
    assert split(b.recorder.take())[0] == []
    # A longer prompt: B announces only the block it stored itself.
    longer = toks[: 2 * bs] + T(41, bs + 10)
    rl = b.add("b3", longer)
    b.run()
    b.step()
    stored, _ = split(b.recorder.take())
    assert [e.block_hashes[0] for e in stored] == [conv(rl.block_hashes[2])]
    del rb

    # A drops the namespace's objects from the pool: B reports them removed.
    want = {(0, conv(x)) for x in hashes} | {(0, conv(rl.block_hashes[2]))}
    assert a.sched.reset_prefix_cache(reset_connector=True)
    a.step()
    seen: set = set()
    deadline = time.monotonic() + 10
    while not want <= seen and time.monotonic() < deadline:
        b.step()
        _, removed = split(b.recorder.take())
        seen |= {(e.group_idx, e.block_hashes[0]) for e in removed}
        time.sleep(0.02)
    assert seen == want
