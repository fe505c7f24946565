"""KV tensors -> pool segments (umbp.vllm.layout) against real torch tensors in vLLM's
layouts, built on CPU: pure shape and stride arithmetic, no GPU needed.

Shapes are (num_blocks, heads, tokens, content) per layer, the logical view vLLM hands to
`register_kv_caches`; what differs between layouts is the physical order underneath.
The last test moves bytes through a real pool between two layouts, which checks that the
segments point at the right bytes, not only that they look plausible.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from umbp.vllm.layout import KVLayout, Segment, kv_layout, merge_adjacent  # noqa: E402

NB, H, N, C = 8, 2, 16, 64  # blocks, KV heads, tokens per block, content (K and V fused)
L = 3  # layers
DT = torch.bfloat16
ES = 2
PAGE = H * N * C * ES  # bytes of one layer's block
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def lbhnc_cpu():
    """vLLM CPU: one buffer, layer l = a contiguous (NB, H, N, C) view at l * NB * PAGE."""
    buf = torch.zeros(L * NB * H * N * C, dtype=DT)
    per = NB * H * N * C
    return buf, {n: buf[i * per : (i + 1) * per].view(NB, H, N, C) for i, n in enumerate(NAMES)}


def lbnhc_gpu_style():
    """GPU default LBNHC: physically (NB, N, H, C) per layer, handed over as (NB, H, N, C)."""
    buf = torch.zeros(L, NB, N, H, C, dtype=DT)
    return buf, {n: buf[i].permute(0, 2, 1, 3) for i, n in enumerate(NAMES)}


def cross_layer_blhnc():
    """Cross-layer BLHNC: block-outermost; each layer's view strides over all layers."""
    buf = torch.zeros(NB, L, H, N, C, dtype=DT)
    return buf, {n: buf[:, i] for i, n in enumerate(NAMES)}


def base(buf):
    return buf.untyped_storage().data_ptr()


def test_cpu_lbhnc_one_segment_per_layer():
    buf, kv = lbhnc_cpu()
    lay = kv_layout(kv, NAMES, NB)
    assert len(lay.storages) == 1 and lay.storages[0].base == base(buf)
    assert lay.storages[0].nbytes == buf.numel() * ES and lay.storages[0].device == "cpu"
    assert lay.segments == [Segment(0, i * NB * PAGE, PAGE, PAGE, NB) for i in range(L)]
    assert lay.object_bytes == L * PAGE


def test_gpu_lbnhc_permuted_page_is_one_range():
    buf, kv = lbnhc_gpu_style()
    t = kv[NAMES[0]]
    assert not t.is_contiguous()  # a permuted view, as on GPU
    lay = kv_layout(kv, NAMES, NB)
    assert lay.segments == [Segment(0, i * NB * PAGE, PAGE, PAGE, NB) for i in range(L)]


def test_cross_layer_merges_into_one_segment():
    buf, kv = cross_layer_blhnc()
    assert kv[NAMES[1]].stride(0) * ES == L * PAGE
    lay = kv_layout(kv, NAMES, NB)
    # Layer pages sit back to back in every block: one copy of L * PAGE per block.
    assert lay.segments == [Segment(0, 0, L * PAGE, L * PAGE, NB)]
    assert lay.object_bytes == kv_layout(lbhnc_cpu()[1], NAMES, NB).object_bytes


def test_legacy_hnd_k_and_v_apart():
    """(2, NB, H, N, D) per layer, each layer its own allocation: K and V pages apart."""
    D = C // 2
    kv = {n: torch.zeros(2, NB, H, N, D, dtype=DT) for n in NAMES}
    lay = kv_layout(kv, NAMES, NB)
    half = H * N * D * ES
    assert len(lay.storages) == L
    assert lay.segments == [Segment(s, k * NB * half, half, half, NB) for s in range(L) for k in (0, 1)]
    assert lay.object_bytes == L * PAGE


def test_legacy_nhd_physical_under_hnd_view():
    D = C // 2
    kv = {n: torch.zeros(2, NB, N, H, D, dtype=DT).permute(0, 1, 3, 2, 4) for n in NAMES}
    lay = kv_layout(kv, NAMES, NB)
    half = H * N * D * ES
    assert [s.page_bytes for s in lay.segments] == [half] * (2 * L)


def test_kv_interleaved_per_block_merges():
    """Logical (2, NB, ...) over physical (NB, 2, ...): K and V of a block are adjacent."""
    D = C // 2
    kv = {n: torch.zeros(NB, 2, H, N, D, dtype=DT).transpose(0, 1) for n in NAMES}
    lay = kv_layout(kv, NAMES, NB)
    half = H * N * D * ES
    assert lay.segments == [Segment(s, 0, 2 * half, 2 * half, NB) for s in range(L)]


def test_flashinfer_blocks_first():
    D = C // 2
    kv = {n: torch.zeros(NB, 2, N, H, D, dtype=DT) for n in NAMES}
    lay = kv_layout(kv, NAMES, NB)
    assert [(s.block_stride, s.page_bytes) for s in lay.segments] == [(PAGE, PAGE)] * L


def test_padded_pages_keep_their_stride():
    pad = 256  # elements of padding after each block (page_size_padded)
    buf = torch.zeros(NB * (H * N * C + pad), dtype=DT)
    t = buf.as_strided((NB, H, N, C), (H * N * C + pad, N * C, C, 1))
    lay = kv_layout({NAMES[0]: t}, NAMES, NB)
    assert lay.segments == [Segment(0, 0, (H * N * C + pad) * ES, PAGE, NB)]


def test_shared_layers_and_group_order():
    buf, kv = lbhnc_cpu()
    kv = dict(kv)
    kv["model.layers.9.self_attn.attn"] = kv[NAMES[0]]  # KV sharing: same tensor again
    names = [NAMES[2], NAMES[0], "model.layers.9.self_attn.attn", NAMES[1], "not.registered"]
    lay = kv_layout(kv, names, NB)
    # The group's order, the shared layer once, unregistered names skipped.
    assert [s.offset // (NB * PAGE) for s in lay.segments] == [2, 0, 1]


def test_scattered_block_is_refused():
    """Heads outermost (H, NB, N, C): a block is H separate ranges. Refused, not misread."""
    buf = torch.zeros(H, NB, N, C, dtype=DT)
    with pytest.raises(ValueError, match=r"layer x: a block is not one contiguous page.*shape"):
        kv_layout({"x": buf.transpose(0, 1)}, ["x"], NB)


def test_wrong_shapes_are_refused():
    with pytest.raises(ValueError, match=r"layer x: unsupported KV cache shape \(7, 2, 16, 64\)"):
        kv_layout({"x": torch.zeros(7, H, N, C, dtype=DT)}, ["x"], NB)
    with pytest.raises(ValueError, match="none of the KV cache group's layers"):
        kv_layout({"x": torch.zeros(NB, H, N, C, dtype=DT)}, ["y"], NB)
    overlap = torch.zeros(NB * N * C + H * N * C, dtype=DT).as_strided((NB, H, N, C), (N * C, N * C, C, 1))
    with pytest.raises(ValueError):
        kv_layout({"x": overlap}, ["x"], NB)


def test_merge_needs_same_stride_and_room():
    a = Segment(0, 0, 100, 40, 4)
    assert merge_adjacent([a, Segment(0, 40, 100, 40, 4)]) == [Segment(0, 0, 100, 80, 4)]
    assert len(merge_adjacent([a, Segment(1, 40, 100, 40, 4)])) == 2  # other storage
    assert len(merge_adjacent([a, Segment(0, 40, 80, 40, 4)])) == 2  # other stride
    assert len(merge_adjacent([a, Segment(0, 41, 100, 40, 4)])) == 2  # a gap
    b = Segment(0, 0, 40, 40, 4)  # one-block-per-page layer next to the next layer
    assert len(merge_adjacent([b, Segment(0, 40, 40, 40, 4)])) == 2


def in_memory_order(page):
    """A block's elements in the order they sit in memory (what the pool copies)."""
    order = sorted(range(page.dim()), key=lambda i: -page.stride(i))
    return page.permute(*order).flatten()


def _register(native, w, lay: KVLayout) -> int:
    ids = [w.register_host_memory(s.base, s.nbytes) for s in lay.storages]
    return int(w.register_layout(0, [s.as_tuple(ids) for s in lay.segments]))


def test_bytes_move_between_layouts_through_a_pool(native):
    """Store from LBHNC, load into cross-layer and LBNHC buffers: every (layer, block) page
    arrives intact where that layout keeps it. (The pool copies bytes: an LBNHC page holds
    an LBHNC page's bytes, which is why the layout is part of the key namespace.)"""
    pool = native.EmbeddedPool(64 << 20, min_object_bytes=4096)
    ns = native.namespace_digest("test_layout")
    try:
        src_buf, src = lbhnc_cpu()
        g = torch.Generator().manual_seed(1)
        src_buf.copy_(torch.randn(src_buf.shape, generator=g).to(DT))
        w_src = native.Worker(pool.socket_path, ns)
        obj = _register(native, w_src, kv_layout(src, NAMES, NB))
        keys = native.object_keys(ns, 0, 0, [bytes([b]) for b in range(NB)])
        assert w_src.wait(w_src.store(0, keys, list(range(NB))), 5000) == [native.STATUS_STORED] * NB
        for make in (cross_layer_blhnc, lbnhc_gpu_style):
            dst_buf, dst = make()
            w = native.Worker(pool.socket_path, ns)
            assert _register(native, w, kv_layout(dst, NAMES, NB)) == obj
            perm = list(reversed(range(NB)))  # block b's object into block NB-1-b
            assert w.wait(w.load(0, keys, perm), 5000) == [native.STATUS_LOADED] * NB
            for name in NAMES:
                for b in range(NB):
                    got, want = in_memory_order(dst[name][perm[b]]), in_memory_order(src[name][b])
                    assert torch.equal(got, want), (make.__name__, name, b)
            w.close()
        w_src.close()
    finally:
        pool.close()
