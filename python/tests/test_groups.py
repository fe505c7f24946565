"""KV cache group arithmetic (groups.py) checked against vLLM's own managers."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("vllm_ok")


def _sw_manager(window: int, block: int):
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                             sliding_window=window)
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=block)
    return SlidingWindowManager(spec, block_pool=pool, kv_cache_group_id=1, enable_caching=True,
                                scheduler_block_size=block)


@pytest.mark.parametrize("window", [128, 200, 4096])
def test_sliding_window_needs_what_vllm_keeps(window):
    from umbp.vllm.groups import SLIDING, GroupInfo

    g = GroupInfo(1, SLIDING, 128, window, ("l",), 1024)
    try:
        mgr = _sw_manager(window, 128)
    except TypeError as e:  # constructor differs between vLLM versions
        pytest.skip(f"skipped: cannot build vLLM's SlidingWindowManager here ({e})")
    for t in (1, 127, 128, 129, 640, 700, 1024):
        assert g.skipped_tokens(t) == mgr.get_num_skipped_tokens(t), t
        need = g.needed_blocks(t)
        assert need.stop == -(-t // 128)
        assert need.start == mgr.get_num_skipped_tokens(t) // 128


def test_full_and_mamba_needs():
    from umbp.vllm.groups import FULL, MAMBA, GroupInfo

    full = GroupInfo(0, FULL, 128, None, ("a",), 1024)
    mamba = GroupInfo(1, MAMBA, 128, None, ("m",), 1024)
    assert full.needed_blocks(640) == range(0, 5)
    assert full.needed_blocks(672) == range(0, 6)
    assert mamba.needed_blocks(640) == range(4, 5)
    assert mamba.needed_blocks(672) == range(5, 6)  # the state inside block 5
    assert full.needed_blocks(0) == range(0)


def test_unsupported_group_is_refused_by_name():
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from umbp.vllm.groups import describe_groups

    spec = ChunkedLocalAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                                     attention_chunk_size=256)
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["x"], spec)])
    with pytest.raises(ValueError, match="KV cache group 0 has a ChunkedLocalAttentionSpec"):
        describe_groups(kcc)
