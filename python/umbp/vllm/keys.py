"""Object keys and the key namespace (docs/protocol.md §3 and docs/architecture.md "An object's life").

A key is xxh3-128 over `(namespace, cache group, rank, vLLM block hash)`, computed by the
binding (`umbp._native.object_key`). The rank is the worker's *KV rank*
(`kv_rank`): `pcp_rank * tp_size + tp_rank`, so it carries the prefill-context-parallel
(PCP) rank in the place the TP rank goes, as the seed's keys carry `tp{r}:pcp{p}` (vLLM's
own worker order within a DP rank; with PCP 1 it is the TP rank, so keys are unchanged). vLLM block hashes carry no model or rank identity, so the
namespace must: it is a digest of a canonical description of everything that makes two
engines' KV bytes for the same tokens identical or not — model, revision, the effective
model config (dtype, quantization, and the HF config with `hf_overrides` applied: a
changed rope scaling or layer count changes the KV), KV cache dtype, block size, KV layout,
the cache groups' shapes, the TP/PCP/DCP topology, the block-hash algorithm and the draft
model of speculative decoding (its layers can share the KV cache) — and deliberately *not*
the data-parallel rank (DP replicas share KV). `key_namespace` in the extra config
replaces the description by a user string.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable, Sequence

from umbp._keys_common import make_keys  # noqa: F401 - re-exported: one implementation for both engines

NAMESPACE_SCHEME = "umbp-vllm-ns-v2"  # v2: effective HF config and draft model


def canonical_namespace_text(vllm_config: Any, kv_cache_config: Any) -> str:
    """The canonical string whose digest is the default key namespace.

    Stable JSON (sorted keys, no whitespace) so that every process — scheduler and each
    worker, on any host — derives the same text from the same engine configuration.
    """
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    groups = []
    for g in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = g.kv_cache_spec
        groups.append(
            {
                "spec": type(spec).__name__,
                "layers": len(g.layer_names),
                "block_size": getattr(spec, "block_size", None),
                "num_kv_heads": getattr(spec, "num_kv_heads", None),
                "head_size": getattr(spec, "head_size", None),
                "head_size_v": getattr(spec, "head_size_v", None),
                "dtype": str(getattr(spec, "dtype", None)),
                "sliding_window": getattr(spec, "sliding_window", None),
                "page_size_bytes": _safe(lambda: spec.page_size_bytes),
            }
        )
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        cc, "kv_cache_layout", None
    )
    desc = {
        "scheme": NAMESPACE_SCHEME,
        "model": str(mc.model),
        "revision": mc.revision,
        "tokenizer_revision": getattr(mc, "tokenizer_revision", None),
        "dtype": str(mc.dtype),
        "quantization": getattr(mc, "quantization", None),
        "cache_dtype": str(cc.cache_dtype),
        "block_size": cc.block_size,
        "kv_layout": str(layout),
        "hash_algo": str(getattr(cc, "prefix_caching_hash_algo", None)),
        "groups": groups,
        "tp": pc.tensor_parallel_size,
        "pcp": getattr(pc, "prefill_context_parallel_size", 1),
        "dcp": getattr(pc, "decode_context_parallel_size", 1),
        "kv_tp_replicas": getattr(kv_cache_config, "kv_tp_replicas", 1),
        "hf_config": hf_config_digest(getattr(mc, "hf_config", None)),
        "hf_overrides": _canonical(getattr(mc, "hf_overrides", None)),
        "draft": draft_model_description(getattr(vllm_config, "speculative_config", None)),
    }
    return json.dumps(desc, sort_keys=True, separators=(",", ":"), default=str)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _canonical(x: Any) -> Any:
    """A JSON-able, process-independent form of a config value.

    Dicts sorted by key, sequences as lists, dtypes and other objects by their text with
    any memory address dropped (it differs between the scheduler and worker processes),
    callables (e.g. an `hf_overrides` function, whose effect is in the HF config) by name.
    """
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, dict):
        return {str(k): _canonical(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_canonical(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted(str(_canonical(v)) for v in x)
    if callable(x) and not hasattr(x, "to_dict"):
        return f"<callable {getattr(x, '__qualname__', type(x).__name__)}>"
    to_dict = getattr(x, "to_dict", None)
    if callable(to_dict):
        try:
            return _canonical(to_dict())
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    return _ADDRESS.sub("", str(x))


def hf_config_digest(hf_config: Any) -> str | None:
    """sha256 of the effective HF config (vLLM applied `hf_overrides` to it already)."""
    if hf_config is None:
        return None
    text = json.dumps(_canonical(hf_config), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def draft_model_description(spec: Any) -> dict[str, Any] | None:
    """What of the speculative-decoding config belongs in the namespace (None without it):
    the method, the draft model and its revision, effective config, dtype and
    quantization, and the number of speculative tokens."""
    if spec is None:
        return None
    dmc = getattr(spec, "draft_model_config", None)
    return {
        "method": _canonical(getattr(spec, "method", None)),
        "model": _canonical(getattr(spec, "model", None)),
        "revision": _canonical(getattr(spec, "revision", None)),
        "num_speculative_tokens": _canonical(getattr(spec, "num_speculative_tokens", None)),
        "quantization": _canonical(getattr(spec, "quantization", None)),
        "draft_dtype": _canonical(getattr(dmc, "dtype", None)) if dmc is not None else None,
        "draft_hf_config": hf_config_digest(getattr(dmc, "hf_config", None)) if dmc is not None else None,
    }


def kv_rank(tp_rank: int, pcp_rank: int, tp_size: int) -> int:
    """The rank a worker's keys carry: its TP rank and PCP rank in one number
    (`pcp_rank * tp_size + tp_rank`, vLLM's worker order inside a DP rank). The namespace
    holds the TP and PCP sizes, so the number names one (TP, PCP) pair unambiguously."""
    if not 0 <= tp_rank < tp_size or pcp_rank < 0:
        raise ValueError(f"bad ranks: tp_rank={tp_rank} (tp_size={tp_size}), pcp_rank={pcp_rank}")
    return pcp_rank * tp_size + tp_rank


def kv_rank_count(tp_size: int, pcp_size: int) -> int:
    """How many KV ranks (workers with their own KV bytes per block) an engine has: every
    one must hold a block for it to be a hit."""
    return max(1, int(tp_size)) * max(1, int(pcp_size))


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a spec without the property just omits it
        return None


def kv_block_hashes(block_hashes: Sequence[bytes], hash_block_size: int, block_size: int) -> list[bytes]:
    """vLLM block hashes at the KV block granularity.

    `request.block_hashes` holds one hash per `hash_block_size` tokens (full blocks only),
    each chained over the whole prefix. When the KV block is `k` times larger, the hash at
    the end of each KV block fingerprints that block's prefix (as in vLLM's
    `BlockHashListWithBlockSize`).
    """
    if hash_block_size == block_size:
        return [bytes(h) for h in block_hashes]
    if block_size % hash_block_size:
        raise ValueError(
            f"KV block size {block_size} is not a multiple of the hash block size "
            f"{hash_block_size}"
        )
    k = block_size // hash_block_size
    return [bytes(h) for h in block_hashes[k - 1 :: k]]

