"""Which KV cache layout the connector asks vLLM for (`kv_layout`, issue #40 Part A).

vLLM resolves one KV cache layout per engine, once, in the engine core
(`resolve_kv_cache_layout`): the layouts every attention backend supports, the connector's
wish (`get_required_kvcache_layout`) when it is one of them, else the backends' first
choice. The pool stores any layout whose block is one dense page per layer
(layout.py), but what it costs differs:

* layer-outermost layouts (`LBNHC`, `LBHNC`: vLLM's GPU and CPU defaults) make an object
  one page per layer, each a separate range. Copy engines reach line rate only from
  64 KiB pages on; smaller pages go through the pool's page copy kernel, which takes SM
  time from the engine (docs/gpu.md);
* block-outermost cross-layer layouts (`BLNHC`, `BLHNC`: block, then layer, then the page)
  put a block of every layer in one contiguous run: one copy-engine copy per object, no
  kernel.

`kv_layout` (connector extra config):
* `auto` (default): a block-outermost cross-layer layout when every attention backend of
  the engine supports it, the manager's block size needs no kernel-block split (vLLM
  cannot split a block whose pages interleave with other layers) and a layer's page is
  below `BLOCK_OUTERMOST_BELOW_PAGE_BYTES`; the engine's own layout otherwise. Among
  block-outermost layouts the backends' order decides, so the block interior stays the
  one the engine would have used (`BLNHC` where nothing declares a preference, as the
  default `LBNHC` has the same interior).
* `engine`: never ask (the engine's own layout).
* a layout name (`BLHNC`, `LBNHC`, ...): ask for it; a start error names the backends when
  one of them does not support it.

`VLLM_KV_CACHE_LAYOUT`, when set, wins over all of this (vLLM reads it first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
from vllm.v1.kv_cache_layout import KVCacheLayout

from ._logging import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionBackend

logger = get_logger("kv_layout")

KEY = "kv_layout"
AUTO = "auto"
ENGINE = "engine"

# Below this page size (one layer's block) copy engines miss line rate and per-layer pages
# take the SM copy kernel. The pool's calibrations on the H200 (docs/data,
# 2026-12-01..04; the slower direction) moved 16/32 KiB pages through copy engines at
# 14-33/29-50 GB/s and 64/128 KiB pages at 47-51/47-52 GB/s; the kernel 47-51 GB/s
# throughout. From 64 KiB on the engine's own layout moves as fast and is left alone.
# To re-measure the line on a GPU host: `umbp-bench transfer --backend cuda --layouts
# kv4k,kv8k,kv16k,gptoss,interference --matmul "python3 scripts/device/matmul_loop.py"
# --reps 5 --json`, once with `--gather copy-engine` and once with the default `auto`: the
# smallest page whose copy-engine store/load reaches the kernel's GB/s (and so needs no
# kernel, whose `<layout>_interference_pct` is the engine's cost) is the line.
BLOCK_OUTERMOST_BELOW_PAGE_BYTES = 64 << 10


def parse_kv_layout(value: Any) -> str:
    """`auto` | `engine` | a `KVCacheLayout` name (any case) -> its canonical spelling.

    Only block-compact layouts (each layer's page one dense range) are accepted: the pool
    refuses the others at registration, so asking vLLM for one would only fail later."""
    if value is None:
        return AUTO
    if isinstance(value, str):
        v = value.strip()
        if v.lower() in (AUTO, ENGINE):
            return v.lower()
        layout = KVCacheLayout.__members__.get(v.upper())
        if layout is not None and layout.is_block_compact:
            return layout.name
        if layout is not None:
            raise ValueError(
                f"{KEY}: {layout.name} scatters a layer's block over several ranges, which the "
                f"pool cannot store; use auto, engine or one of {', '.join(_compact_names())}"
            )
    raise ValueError(f"{KEY}: expected auto, engine or one of {', '.join(_compact_names())}, got {value!r}")


def _compact_names() -> list[str]:
    return [m.name for m in KVCacheLayout if m.is_block_compact]


def cross_layer_layouts(layouts: Sequence[KVCacheLayout]) -> list[KVCacheLayout]:
    """The layouts of `layouts` (order kept) in which a block of every layer is one
    contiguous run of dense per-layer pages: block outermost, layer next."""
    return [m for m in layouts if m.is_block_outermost and m.is_block_compact]


@dataclass(frozen=True)
class LayoutChoice:
    layout: str | None  # the name to ask vLLM for; None: the engine's own
    reason: str


def _backend_names(backends: Sequence[type["AttentionBackend"]]) -> str:
    def declared(b: type["AttentionBackend"]) -> str:
        d = b.supported_kv_cache_layouts()
        return "any layout" if d is None else "/".join(m.name for m in d)

    return ", ".join(f"{b.get_name()} ({declared(b)})" for b in backends)


def _block_size_needs_no_split(backends: Sequence[type["AttentionBackend"]], block_size: int) -> bool:
    """Whether every backend's kernels take `block_size` whole (vLLM's own check)."""
    from vllm.v1.worker.utils import select_common_block_size

    try:
        return select_common_block_size(block_size, list(backends)) == block_size
    except ValueError:
        return False


def choose_layout(
    choice: str,
    backends: Sequence[type["AttentionBackend"]],
    page_bytes: int | None,
    block_size: int | None,
) -> LayoutChoice:
    """The layout `choice` (parsed `kv_layout`) asks for, given the engine's attention
    `backends`, one layer's page in bytes and the manager's block size (None: unknown).

    Raises ValueError naming `kv_layout` and the backends for an explicit layout that a
    backend does not support."""
    if choice == ENGINE:
        return LayoutChoice(None, "kv_layout=engine")
    try:
        supported = get_supported_kv_cache_layouts(backends) if backends else []
    except ValueError as e:  # the backends share no layout: vLLM itself refuses to start
        supported, no_common = [], str(e)
    else:
        no_common = ""
    if choice != AUTO:
        if not backends:
            # Nothing to check against here; vLLM checks the workers' backends itself.
            return LayoutChoice(choice, f"kv_layout={choice} (the attention backends are not known here)")
        if KVCacheLayout[choice] not in supported:
            raise ValueError(
                f"{KEY}: {choice} is not supported by every attention backend of this engine: "
                f"{_backend_names(backends)}; layouts all of them support: "
                f"{', '.join(m.name for m in supported) or 'none'} (or use auto / engine)"
                + (f" [{no_common}]" if no_common else "")
            )
        return LayoutChoice(choice, f"kv_layout={choice}")
    if not backends:
        return LayoutChoice(None, "auto: the engine's attention backends are not known")
    cross = cross_layer_layouts(supported)
    if not cross:
        return LayoutChoice(
            None, f"auto: no cross-layer layout is supported by every backend: {_backend_names(backends)}"
        )
    if page_bytes is None or block_size is None:
        return LayoutChoice(None, "auto: the model's KV page size is not known")
    if page_bytes >= BLOCK_OUTERMOST_BELOW_PAGE_BYTES:
        return LayoutChoice(
            None,
            f"auto: {page_bytes}-byte pages reach line rate through copy engines in the "
            f"engine's own layout (from {BLOCK_OUTERMOST_BELOW_PAGE_BYTES} bytes)",
        )
    if not _block_size_needs_no_split(backends, block_size):
        return LayoutChoice(
            None,
            f"auto: block size {block_size} would be split into kernel blocks, which a "
            "cross-layer layout does not allow",
        )
    return LayoutChoice(
        cross[0].name,
        f"auto: {page_bytes}-byte pages, every backend supports {cross[0].name} "
        f"({_backend_names(backends)})",
    )


def model_page_bytes(vllm_config: "VllmConfig") -> int | None:
    """Bytes of one attention layer's block on one rank, as vLLM's own KV cache spec counts
    them (K and V, or MLA's single latent); None where the config does not tell."""
    import torch

    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype, resolve_kv_cache_dtype_string
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if mc is None or cc is None or not cc.block_size:
        return None
    try:
        cache_dtype = resolve_kv_cache_dtype_string(cc.cache_dtype, mc)
        dtype = kv_cache_dtype_str_to_dtype(cache_dtype, mc)
        common: dict[str, Any] = dict(
            block_size=cc.block_size,
            num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
            head_size=mc.get_head_size(),
            dtype=dtype if isinstance(dtype, torch.dtype) else torch.bfloat16,
        )
        if mc.use_mla:
            spec = MLAAttentionSpec(**common, cache_dtype_str=cache_dtype)
        else:
            spec = FullAttentionSpec(**common)
        return int(spec.page_size_bytes)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        logger.info("UMBP: kv_layout: cannot tell the model's KV page size (%s)", e)
        return None


def engine_attn_backends(vllm_config: "VllmConfig") -> list[type["AttentionBackend"]]:
    """The engine's attention backends as vLLM finds them (its layers where this process
    has them, else the platform's selection for the model); [] where that fails."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    try:
        return list(get_current_attn_backends(vllm_config))
    except Exception as e:  # noqa: BLE001 - a selector error must not stop the engine here
        logger.info("UMBP: kv_layout: cannot tell the engine's attention backends (%s)", e)
        return []


_LOGGED: set[str] = set()


def required_kv_layout(vllm_config: "VllmConfig") -> str | None:
    """`get_required_kvcache_layout` of the connector: the layout name or None."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    extra: Mapping[str, Any] = (getattr(ktc, "kv_connector_extra_config", None) or {}) if ktc else {}
    choice = parse_kv_layout(extra.get(KEY))
    if choice == ENGINE or getattr(vllm_config, "model_config", None) is None:
        return None
    cc = vllm_config.cache_config
    result = choose_layout(
        choice, engine_attn_backends(vllm_config), model_page_bytes(vllm_config), cc.block_size
    )
    asked = result.layout or "the engine's own"
    line = f"UMBP: KV cache layout {asked}: {result.reason}"
    if line not in _LOGGED:  # vLLM asks more than once per process
        _LOGGED.add(line)
        logger.info(line)
    return result.layout
