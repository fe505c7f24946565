"""vLLM's KV cache groups as the connector sees them (hybrid models): pure arithmetic.

vLLM's hybrid KV cache manager gives a model one KV cache group per kind of layer:
* `full`: full attention (also MLA); a prefix of `t` tokens needs every block before `t`;
* `sliding`: sliding-window attention; only the blocks inside the window of the next token
  are needed, the ones before it are vLLM's null block;
* `mamba`: Mamba / linear-attention state ("align" cache mode); a prefix of `t` tokens needs
  only the state after token `t`, held in one block (index `ceil(t / block_size) - 1`) and
  keyed by the block hash of the prefix ending at `t` (which may end inside a block).

One pool object is one block of every layer of one group, keyed by (namespace, group, rank,
block hash): the group is part of every key. Groups that are not prefix-cacheable (cross
attention, encoder-only) are not the connector's business; any other prefix-cacheable kind
is refused at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

FULL = "full"
SLIDING = "sliding"
MAMBA = "mamba"


@dataclass(frozen=True)
class GroupInfo:
    gid: int
    kind: str  # FULL | SLIDING | MAMBA
    block_size: int
    sliding_window: int | None
    layer_names: tuple[str, ...]
    page_bytes: int | None  # one block of one layer, when vLLM knows it
    # vLLM's name of the group's kind in KV events (`BlockStored.kv_cache_spec_kind`:
    # "full_attention", "mla_attention", "sliding_window", "mamba"); None: derive from `kind`.
    spec_kind: str | None = None

    @property
    def event_kind(self) -> str:
        """`kv_cache_spec_kind` of this group's `BlockStored` events."""
        return self.spec_kind or _EVENT_KIND[self.kind]

    def skipped_tokens(self, num_tokens: int) -> int:
        """Leading tokens whose KV this group no longer needs once `num_tokens` are
        computed (vLLM's `SlidingWindowManager.get_num_skipped_tokens`)."""
        if self.kind == SLIDING and self.sliding_window:
            return max(0, num_tokens - self.sliding_window + 1)
        return 0

    def needed_blocks(self, num_tokens: int) -> range:
        """Indices of this group's blocks a prefix hit of `num_tokens` must restore."""
        if num_tokens <= 0:
            return range(0)
        last = -(-num_tokens // self.block_size)  # ceil
        if self.kind == MAMBA:
            return range(last - 1, last)
        return range(self.skipped_tokens(num_tokens) // self.block_size, last)


_EVENT_KIND = {FULL: "full_attention", SLIDING: "sliding_window", MAMBA: "mamba"}


def _spec_kind(spec: Any) -> str | None:
    """vLLM's own `kv_cache_spec_kind` of `spec` (vLLM versions that have it), as its
    block pool and offloading connectors put it in their KV events."""
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
    except ImportError:
        return None
    try:
        kind = get_kv_cache_spec_kind(spec)
    except Exception:  # noqa: BLE001 - a spec vLLM cannot classify: derive from ours
        return None
    value = str(getattr(kind, "value", kind))
    return None if value == "unknown" else value


def _kind(spec: Any) -> str | None:
    from vllm.v1 import kv_cache_interface as kci

    mamba = getattr(kci, "MambaSpec", None)
    sliding = getattr(kci, "SlidingWindowSpec", None)
    full = getattr(kci, "FullAttentionSpec", None)
    uniform = getattr(kci, "UniformTypeKVCacheSpecs", None)
    if uniform is not None and isinstance(spec, uniform):
        kinds = {_kind(s) for s in spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else None
    if mamba is not None and isinstance(spec, mamba):
        return MAMBA
    if sliding is not None and isinstance(spec, sliding):
        return SLIDING
    # Full-attention variants whose blocks do not hold the plain prefix KV are not ours.
    if full is not None and isinstance(spec, full) and type(spec).__name__ in (
        "FullAttentionSpec",
        "MLAAttentionSpec",
    ):
        return FULL
    return None


def describe_groups(kv_cache_config: Any) -> list[GroupInfo]:
    """The prefix-cacheable groups of `kv_cache_config`, or ValueError naming the one the
    connector cannot handle."""
    groups = kv_cache_config.kv_cache_groups
    ids = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    if ids is None:
        ids = tuple(range(len(groups)))
    out: list[GroupInfo] = []
    for gid in ids:
        g = groups[gid]
        spec = g.kv_cache_spec
        kind = _kind(spec)
        if kind is None:
            raise ValueError(
                f"UMBPStoreConnector: KV cache group {gid} has a {type(spec).__name__} "
                "(supported: full attention, MLA, sliding window, Mamba/linear-attention state)"
            )
        if kind == MAMBA and getattr(spec, "mamba_cache_mode", "align") != "align":
            raise ValueError(
                f"UMBPStoreConnector: KV cache group {gid} is a Mamba state group with "
                f"mamba_cache_mode={spec.mamba_cache_mode!r}; prefix caching of Mamba states "
                "needs mamba_cache_mode='align'"
            )
        try:
            # A Mamba page may be padded to the attention page: only the state is stored.
            page = int(spec.real_page_size_bytes if kind == MAMBA else spec.page_size_bytes)
        except Exception:  # noqa: BLE001
            page = None
        sw = getattr(spec, "sliding_window", None)
        out.append(
            GroupInfo(
                gid, kind, int(spec.block_size), int(sw) if sw else None, tuple(g.layer_names), page,
                _spec_kind(spec),
            )
        )
    if not out:
        raise ValueError("UMBPStoreConnector: this model has no prefix-cacheable KV cache group")
    return out


def forces_async_load(groups: Sequence[GroupInfo], kv_cache_config: Any, hf_config: Any = None) -> str | None:
    """Why loads must be asynchronous for this model, or None.

    Mamba-style layers (and sparse-attention indexers) read their restored state before a
    synchronous load, which only waits at the first attention layer, could land.
    """
    if any(g.kind == MAMBA for g in groups):
        return "the model has Mamba/linear-attention state layers"
    for g in kv_cache_config.kv_cache_groups:
        name = type(g.kv_cache_spec).__name__
        if "Indexer" in name or "HiSparse" in name:
            return f"the model has sparse-attention indexer layers ({name})"
    if hf_config is not None and getattr(hf_config, "index_topk", None):
        return "the model has a sparse-attention indexer (index_topk)"
    return None


def scheduler_block_size(groups: Sequence[GroupInfo]) -> int:
    """Hits land on multiples of every group's block size (vLLM's scheduler block size)."""
    import math

    return math.lcm(*(g.block_size for g in groups))
