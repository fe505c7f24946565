"""`UMBPStoreConnector`: vLLM v1 KV connector backed by a UMBP DRAM pool.

Load it with
    kv_transfer_config={"kv_connector": "UMBPStoreConnector",
                        "kv_connector_module_path": "umbp.vllm",
                        "kv_role": "kv_both",
                        "kv_load_failure_policy": "recompute",   # recommended
                        "kv_connector_extra_config": {...}}      # see config.py

vLLM builds one instance per role (see docs/vllm-interface-notes.md for the observed calls):

* **scheduler role** (EngineCore process): prefix lookups in the pool's shared index
  (`umbp._native.Index`, memory reads, no RPC), and per step a plan of loads and stores
  (`UMBPConnectorMetadata`) sent to every worker.
* **worker role** (one per TP rank and PCP rank): registers the paged KV tensors with the pool once,
  submits the planned transfers (`umbp._native.Worker`, non-blocking) and reaps them.

The pool copies the bytes (docs/gpu.md "Stream-ordered transfers"); no KV byte goes through Python. Modes:

* `embedded` (default): each worker runs its own `EmbeddedPool`, listening on a private socket
  derived from (engine id, DP rank, TP rank, PCP rank with PCP > 1); the scheduler attaches
  one `Index` per worker.
* `standalone`: every worker and the scheduler attach to the node's `umbp-pool`
  (`endpoint`, else `$UMBP_STANDALONE_ADDRESS`, else the binding's default socket).

Correctness rules this file keeps (vLLM contract, docs/connection.md "Failure rules"):
* only whole blocks, keyed by vLLM's chained block hashes + a namespace + the KV cache group
  (keys.py); hybrid models (several groups: full attention, sliding window, Mamba state) are
  described in groups.py and docs/vllm-hybrid.md;
* a hit is reported only for leading blocks present for *every* KV rank (each TP rank, and
  each PCP rank of each with prefill context parallelism: keys carry the PCP rank);
* stores are submitted after the forward (`wait_for_save`) and never block the step; a
  finished request whose stores are still in flight keeps its blocks (`request_finished`
  returns True) until every worker reports it in `get_finished`; preempted requests wait for
  their in-flight stores in `handle_preemptions` (their blocks are reused right after);
* failed or missing loads are reported by block id (`get_block_ids_with_load_errors`); with
  `kv_load_failure_policy="recompute"` vLLM recomputes them, never a wrong token (under
  "recompute" loads are always asynchronous: `load_async=false` is ignored);
* if the pool is gone: lookups miss, loads fail (recompute), stores are dropped — no error.

This module is the facade vLLM talks to; the work is done elsewhere, one concern each:
`config.py` (extra config), `kv_layout_choice.py` (the KV layout asked of vLLM),
`keys.py` (namespace and object keys), `metadata.py` (what
goes between scheduler and workers), `scheduler_side.py`, `worker_side.py`, `layout.py`
(KV tensors -> pool segments), `stats.py`. The native module is imported when the connector
is constructed, so importing this file only needs vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from ._logging import get_logger
from .config import (
    OffloadOptions,
    UMBPConnectorConfig,
    check_parallelism,
    load_failure_policy_warning,
    prefix_caching_warning,
    transfer_directions,
)
from .endpoints import embedded_socket_path, load_native
from .groups import FULL, describe_groups, forces_async_load, scheduler_block_size
from .keys import canonical_namespace_text, kv_rank_count, make_keys
from .kv_layout_choice import required_kv_layout
from .metadata import BlockOp, UMBPConnectorMetadata, UMBPWorkerMetadata
from .replicas import replica_plan
from .scheduler_side import SchedulerSide
from .stats import UMBPConnectorStats, UMBPPromMetrics
from .worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger("connector")

# Re-exported: older code imports these from here.
__all__ = [
    "BlockOp",
    "UMBPConnectorMetadata",
    "UMBPStoreConnector",
    "UMBPWorkerMetadata",
    "embedded_socket_path",
    "make_keys",
]


class UMBPStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector for UMBP (both roles; the role picks the half that runs)."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._native = load_native()
        ktc = self._kv_transfer_config
        self._cfg = UMBPConnectorConfig.from_extra_config(
            ktc.kv_connector_extra_config, self._native.default_socket_path
        )
        # vLLM's kv_load_failure_policy: with "recompute" a failed load's request recomputes
        # into the same blocks, so a started load can never hand them back early.
        self._recompute_failures = getattr(ktc, "kv_load_failure_policy", "fail") == "recompute"
        pc = vllm_config.parallel_config
        # Prefill context parallelism: every (TP, PCP) worker holds its own KV bytes and keys
        # them with its KV rank (keys.kv_rank); a hit needs all of them.
        self._pcp_size = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
        check_parallelism(
            pc.pipeline_parallel_size,
            self._pcp_size,
            int(getattr(pc, "decode_context_parallel_size", 1) or 1),
        )
        if kv_cache_config is None:
            raise ValueError("UMBPStoreConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")

        # Hybrid models (HMA): one entry per prefix-cacheable KV cache group (groups.py).
        self._groups = describe_groups(kv_cache_config)
        self._group = next((g.gid for g in self._groups if g.kind == FULL), self._groups[0].gid)
        # Hits land on multiples of every group's block size (one group: its block size).
        self._block_size = scheduler_block_size(self._groups)
        # One object = one block of every layer of a group: the embedded pool sizes its
        # index for objects this small (it refuses layouts below its minimum object size).
        sizes = [g.page_bytes * len(g.layer_names) for g in self._groups if g.page_bytes]
        self._object_bytes_estimate = min(sizes) if sizes else None
        self._hash_block_size = int(
            getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size
        )
        self._offload = OffloadOptions.from_extra_config(ktc.kv_connector_extra_config).derive_max_blocks(
            getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None), self._block_size
        )
        self._partial_hits = self._offload.enable_partial_hash_hits and check_partial_hash_hits(
            vllm_config, kv_cache_config, self._groups, self._hash_block_size
        )
        # Mamba-style and sparse-indexer layers read restored state before a synchronous
        # load could land: such models always load asynchronously.
        why_async = forces_async_load(
            self._groups, kv_cache_config, getattr(vllm_config.model_config, "hf_config", None)
        )
        if why_async is None and self._recompute_failures:
            # vLLM recomputes a failed synchronous load into the same blocks, which a load
            # the pool started and did not finish in timeout_ms may still write: such a load
            # would hold the engine step until the pool finishes or dies. An asynchronous
            # load holds only its own request (docs/connection.md).
            why_async = "kv_load_failure_policy is 'recompute'"
        self._force_async = why_async is not None
        self._load_async = self._cfg.load_async or self._force_async
        if why_async and not self._cfg.load_async and role == KVConnectorRole.SCHEDULER:
            logger.warning("UMBP: load_async=false ignored: loads are always asynchronous when %s", why_async)
        self._gpu_block_pool: Any = None
        self._tp_size = pc.tensor_parallel_size
        # Workers per engine (DP rank) with their own KV bytes: TP ranks × PCP ranks.
        self._num_ranks = kv_rank_count(self._tp_size, self._pcp_size)
        # KV the TP ranks hold alike (MLA, replicated KV heads) is stored once per replica
        # group where the ranks share a pool (replicas.py); keys then carry the key rank.
        self._replicas = replica_plan(
            vllm_config,
            kv_cache_config,
            [g.kind for g in self._groups],
            enabled=self._cfg.store_replicas_once,
            standalone=not self._cfg.embedded,
        )
        self._key_ranks = self._replicas.key_ranks
        self._dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        self._engine_id = str(ktc.engine_id)
        self._do_load, self._do_store = transfer_directions(ktc.kv_role)
        warning = load_failure_policy_warning(
            getattr(ktc, "kv_load_failure_policy", None), loads=self._do_load
        )
        if warning and role == KVConnectorRole.SCHEDULER:
            logger.warning(warning)
        pc_warning = prefix_caching_warning(vllm_config.cache_config.enable_prefix_caching)
        if pc_warning and role == KVConnectorRole.SCHEDULER:
            logger.warning(pc_warning)
        # BlockStored events cost a little per stored block: only when someone listens.
        kec = getattr(vllm_config, "kv_events_config", None)
        self._events_enabled = bool(getattr(kec, "enable_kv_cache_events", False))

        # Key namespace: digest of the canonical engine description (or the user's string).
        self._ns_text = (
            self._cfg.key_namespace or canonical_namespace_text(vllm_config, kv_cache_config)
        ) + self._replicas.namespace_suffix()
        self._base_namespace = bytes(self._native.namespace_digest(self._ns_text))
        self._stats = UMBPConnectorStats()

        if role == KVConnectorRole.SCHEDULER:
            self._sched: SchedulerSide | None = SchedulerSide(self)
            self._worker: WorkerSide | None = None
        else:
            self._sched = None
            self._worker = WorkerSide(self)
        logger.info(
            "UMBPStoreConnector %s: mode=%s kv_role=%s load_async=%s block_size=%d "
            "groups=%s lazy_offload=%s replicas=%d (%s) namespace=%s (%s)",
            "scheduler" if self._sched else "worker",
            self._cfg.mode,
            ktc.kv_role,
            self._load_async,
            self._block_size,
            ",".join(f"{g.gid}:{g.kind}/{g.block_size}" for g in self._groups),
            self._offload.lazy_offload,
            self._replicas.replicas,
            self._replicas.why,
            self._base_namespace.hex(),
            "key_namespace" if self._cfg.key_namespace else "derived",
        )

    # ---- class-level hooks --------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> UMBPConnectorStats:
        return UMBPConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> UMBPPromMetrics:
        # Counters vllm:umbp_* in vLLM's own /metrics (stats.py).
        return UMBPPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        # vLLM >= 0.33 asks before enabling sleep mode: the pool holds the KV memory
        # registered at start (CUDA IPC / process memory), which sleep mode would release
        # and remap under it.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        # `kv_layout`: a cross-layer layout where it spares the page copy kernel, else
        # None (any layout whose blocks are dense pages, checked at registration).
        return required_kv_layout(vllm_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is just a future miss

    # ---- scheduler side -----------------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        # Used to pin blocks while the pool reads them (sliding-window and Mamba groups,
        # whose blocks vLLM frees while the request runs; lazy offload's free blocks).
        self._gpu_block_pool = gpu_block_pool

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        # Pinned stores (sliding-window/Mamba blocks, lazy offload) end with a worker report:
        # keep the engine stepping until they did, or their blocks stay pinned while idle.
        return self._sched is not None and self._sched.has_pins()

    def has_pending_block_frees(self) -> bool:
        # Pinned blocks come back within a transfer: wait for them rather than preempt.
        return self._sched is not None and self._sched.has_pins()

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # One decision for all groups: the request's own blocks (full attention) are held
        # while its stores run; other groups' stored blocks are pinned (scheduler_side.py).
        return self.request_finished(request, block_ids)  # type: ignore[arg-type]

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def take_events(self) -> Iterable[Any]:
        return self._sched.take_events() if self._sched is not None else ()

    def reset_cache(self) -> bool | None:
        return self._sched.reset_cache() if self._sched is not None else None

    def get_kv_connector_stats(self) -> UMBPConnectorStats | None:
        return self._stats.take()

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, UMBPConnectorMetadata):
            self._worker.on_metadata(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, UMBPConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, UMBPConnectorMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_sync_loads()

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: "AttentionMetadata",
        **kwargs: Any,
    ) -> None:
        # Objects span all layers of a block, and the pool copies whole objects after the
        # forward (wait_for_save); nothing to do per layer.
        return

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, UMBPConnectorMetadata)
        self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()


def check_partial_hash_hits(
    vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", groups: list, hash_block_size: int
) -> bool:
    """`enable_partial_hash_hits`: True when this vLLM and this model can hit inside a
    block; otherwise ValueError naming the option, the vLLM version and what is missing."""
    import vllm

    version = getattr(vllm, "__version__", "?")
    cc = vllm_config.cache_config
    if not hasattr(cc, "prefix_match_unit"):
        raise ValueError(
            "enable_partial_hash_hits: this vLLM "
            f"({version}) has no cache_config.prefix_match_unit, so hits cannot end inside a "
            "block; unset enable_partial_hash_hits or use a vLLM that has prefix_match_unit"
        )
    try:
        from vllm.v1.core.kv_cache_utils import partial_hash_hits_enabled
    except ImportError:
        partial_hash_hits_enabled = None
    ok = partial_hash_hits_enabled is not None and partial_hash_hits_enabled(
        kv_cache_config.kv_cache_groups,
        hash_block_size,
        int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1),
    )
    if not ok:
        raise ValueError(
            "enable_partial_hash_hits: with this model vLLM "
            f"{version} has no hits inside a block (prefix_match_unit={cc.prefix_match_unit}, "
            f"hash block {hash_block_size} tokens, group block sizes "
            f"{[g.block_size for g in groups]}): vLLM only lands hits inside a block for "
            "hybrid models with a Mamba state group in mamba_cache_mode='align' whose block is "
            "larger than cache_config.prefix_match_unit; unset enable_partial_hash_hits or set "
            "prefix_match_unit"
        )
    return True
