"""Replicated KV stored once (issue #36; docs/vllm.md "Replicated KV").

Some TP ranks of an engine hold the same KV bytes for a block:

* an MLA model's latent cache is the same on every TP rank (vLLM replicates it);
* a model with fewer KV heads than TP ranks gives each head to `tp / kv_heads` consecutive
  ranks (vLLM's `num_kv_head_replicas`: rank `r` holds head `r // replicas`).

Storing each rank's copy under its own key fills the pool `replicas` times with the same
bytes. With a plan of `replicas > 1`, keys carry the *key rank* (the replica group) instead
of the TP rank, exactly one rank of a group stores each block (chosen by the block's key, so
the stores of a batch spread over the group and run in parallel), and every rank of the
group loads it. A hit needs one copy per key rank.

This needs every rank of a group to reach the same pool, so it applies in standalone mode
only: an embedded pool lives in one worker and its peers cannot load from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .groups import MAMBA


@dataclass(frozen=True)
class ReplicaPlan:
    """Which TP ranks share their KV bytes, and who stores what."""

    tp_size: int
    pcp_size: int
    replicas: int  # consecutive TP ranks holding the same bytes (1: none share)
    why: str  # why this plan (shown in the start log and docs)

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.tp_size % self.replicas:
            raise ValueError(f"replicas {self.replicas} does not divide tp_size {self.tp_size}")

    @property
    def key_ranks(self) -> int:
        """Distinct key ranks of an engine: one copy of a block per key rank makes a hit."""
        return max(1, self.pcp_size) * (self.tp_size // self.replicas)

    def key_rank(self, tp_rank: int, pcp_rank: int = 0) -> int:
        """The rank a worker's keys carry: its replica group within its PCP rank (equal to
        `keys.kv_rank` when nothing is replicated)."""
        return pcp_rank * (self.tp_size // self.replicas) + tp_rank // self.replicas

    def stores(self, tp_rank: int, key: bytes) -> bool:
        """Whether the worker of TP rank `tp_rank` is the one that stores the object `key`
        (keys are uniform hashes, so blocks spread evenly over the group's ranks)."""
        if self.replicas == 1:
            return True
        return int.from_bytes(bytes(key[:8]), "little") % self.replicas == tp_rank % self.replicas

    def namespace_suffix(self) -> str:
        """Mixed into the key namespace text (also a user's `key_namespace`): keys of a
        replicated plan name replica groups, not TP ranks, so they must never meet keys of
        another plan."""
        return "" if self.replicas == 1 else f"|kv-replicas={self.replicas}"


def _spec_replicas(spec: Any, tp: int, total_kv_heads: int | None) -> tuple[int, str]:
    """(replicas, why) for one KV cache group's spec."""
    name = type(spec).__name__
    if "MLA" in name:
        return tp, "MLA latent cache (the same on every TP rank)"
    if total_kv_heads and total_kv_heads < tp and tp % total_kv_heads == 0:
        return tp // total_kv_heads, f"{total_kv_heads} KV head(s) over {tp} TP ranks"
    return 1, "every TP rank holds its own KV heads"


def replica_plan(
    vllm_config: Any,
    kv_cache_config: Any,
    group_kinds: Sequence[str],
    *,
    enabled: bool,
    standalone: bool,
) -> ReplicaPlan:
    """The plan for this engine. Off (`replicas == 1`, with the reason) unless every rank of
    a group shares one pool (standalone), the option is on, decode context parallelism is
    off (it shards tokens over the TP ranks), and every cache group is attention whose
    replication factor is the same (Mamba state is sharded by TP)."""
    pc = vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    pcp = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)

    def off(why: str) -> ReplicaPlan:
        return ReplicaPlan(tp, pcp, 1, why)

    if tp == 1:
        return off("one TP rank")
    if not enabled:
        return off("store_replicas_once=false")
    if not standalone:
        return off("embedded mode: each TP rank has its own pool, which the others cannot load from")
    if dcp > 1:
        return off(f"decode_context_parallel_size={dcp} shards the tokens over the TP ranks")
    if any(k == MAMBA for k in group_kinds):
        return off("a Mamba/linear-attention group (its state is sharded over the TP ranks)")
    try:
        total = int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:  # noqa: BLE001 - a config without heads (MLA-only) decides by spec
        total = None
    plans = {
        _spec_replicas(g.kv_cache_spec, tp, total)
        for g in getattr(kv_cache_config, "kv_cache_groups", None) or []
    }
    if len({r for r, _ in plans}) != 1:
        return off("the cache groups replicate differently over the TP ranks")
    ((replicas, why),) = plans
    return ReplicaPlan(tp, pcp, replicas, why)
