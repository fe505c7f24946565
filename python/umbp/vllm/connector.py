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
* **worker role** (one per TP rank): registers the paged KV tensors with the pool once,
  submits the planned transfers (`umbp._native.Worker`, non-blocking) and reaps them.

The pool copies the bytes (DESIGN §7); no KV byte goes through Python. Modes:

* `embedded` (default): each worker runs its own `EmbeddedPool`, listening on a private socket
  derived from (engine id, DP rank, TP rank); the scheduler attaches one `Index` per TP rank.
* `standalone`: every worker and the scheduler attach to the node's `umbp-pool`
  (`endpoint`, else `$UMBP_STANDALONE_ADDRESS`, else the binding's default socket).

Correctness rules this file keeps (vLLM contract, DESIGN §9):
* only whole blocks, keyed by vLLM's chained block hashes + a namespace (keys.py);
* a hit is reported only for leading blocks present for *every* TP rank;
* stores are submitted after the forward (`wait_for_save`) and never block the step; a
  finished request whose stores are still in flight keeps its blocks (`request_finished`
  returns True) until every worker reports it in `get_finished`; preempted requests wait for
  their in-flight stores in `handle_preemptions` (their blocks are reused right after);
* failed or missing loads are reported by block id (`get_block_ids_with_load_errors`); with
  `kv_load_failure_policy="recompute"` vLLM recomputes them, never a wrong token;
* if the pool is gone: lookups miss, loads fail (recompute), stores are dropped — no error.

This module is the facade vLLM talks to; the work is done elsewhere, one concern each:
`config.py` (extra config), `keys.py` (namespace and object keys), `metadata.py` (what
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
)

from ._logging import get_logger
from .config import (
    UMBPConnectorConfig,
    check_parallelism,
    load_failure_policy_warning,
    prefix_caching_warning,
    transfer_directions,
)
from .endpoints import embedded_socket_path, load_native
from .keys import canonical_namespace_text, make_keys
from .metadata import BlockOp, UMBPConnectorMetadata, UMBPWorkerMetadata
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


class UMBPStoreConnector(KVConnectorBase_V1):
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
        pc = vllm_config.parallel_config
        check_parallelism(
            pc.pipeline_parallel_size, int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
        )
        if kv_cache_config is None:
            raise ValueError("UMBPStoreConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")

        groups = tuple(kv_cache_config.prefix_cacheable_group_ids)
        if len(groups) != 1:
            raise ValueError(
                "UMBPStoreConnector supports models with exactly one prefix-cacheable KV "
                f"cache group; this model has {len(groups)} ({groups})"
            )
        self._group = groups[0]
        spec = kv_cache_config.kv_cache_groups[self._group].kv_cache_spec
        self._block_size = int(spec.block_size)
        # One object = one block of every layer of the group: the embedded pool sizes its
        # index for objects this small (it refuses layouts below its minimum object size).
        page = getattr(spec, "page_size_bytes", None)
        layers = len(kv_cache_config.kv_cache_groups[self._group].layer_names)
        self._object_bytes_estimate = int(page) * layers if page else None
        self._hash_block_size = int(
            getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size
        )
        self._tp_size = pc.tensor_parallel_size
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
        self._ns_text = self._cfg.key_namespace or canonical_namespace_text(
            vllm_config, kv_cache_config
        )
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
            "namespace=%s (%s)",
            "scheduler" if self._sched else "worker",
            self._cfg.mode,
            ktc.kv_role,
            self._cfg.load_async,
            self._block_size,
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
        return None  # any layout whose blocks are dense pages (checked at registration)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is just a future miss

    # ---- scheduler side -----------------------------------------------------------------
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
