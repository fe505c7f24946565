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

The native module is imported when the connector is constructed, so importing this file
only needs vLLM.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from .config import UMBPConnectorConfig
from .keys import canonical_namespace_text, kv_block_hashes
from .stats import UMBPConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

try:  # under the "vllm" logger: same handlers, format and VLLM_LOGGING_LEVEL as the engine
    from vllm.logger import init_logger

    logger = init_logger("vllm.umbp.connector")
except Exception:  # noqa: BLE001
    logger = logging.getLogger(__name__)


def _load_native() -> Any:
    try:
        import umbp._native as native
    except ImportError as e:
        raise ImportError(
            "UMBPStoreConnector needs the compiled binding umbp._native "
            "(build it with `maturin develop -m python/Cargo.toml` or install the umbp wheel): "
            f"{e}"
        ) from e
    return native


def make_keys(native: Any, namespace: bytes, group: int, rank: int, hashes: list[bytes]) -> list[bytes]:
    """Object keys of `hashes` for one rank (one native call when the binding batches)."""
    batch = getattr(native, "object_keys", None)
    if batch is not None:
        return list(batch(namespace, group, rank, hashes))
    ok = native.object_key
    return [ok(namespace, group, rank, h) for h in hashes]


def embedded_socket_path(default_socket_path: str, engine_id: str, dp_rank: int, tp_rank: int) -> str:
    """Private socket of one worker's embedded pool.

    In the default socket directory, named after a digest of the engine id (unix socket
    paths are limited to 107 bytes) plus the DP and TP rank, so two engines or DP ranks on
    one host never collide. The pool itself refuses to take over a live listener.
    """
    d = os.path.dirname(default_socket_path) or tempfile.gettempdir()
    try:
        os.makedirs(d, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(d)
    except OSError:
        d = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    tag = hashlib.sha256(str(engine_id).encode()).hexdigest()[:16]
    return os.path.join(d, f"umbp-emb-{tag}-dp{dp_rank}-tp{tp_rank}.sock")


# ---------------------------------------------------------------------------------------
# Scheduler -> worker metadata (one per step), worker -> scheduler metadata.
# Plain dataclasses of bytes/ints/strs: they are pickled to worker processes.
# ---------------------------------------------------------------------------------------


@dataclass
class BlockOp:
    """Transfer `hashes[i]` <-> paged KV block `block_ids[i]` for one request."""

    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    # Loads only: True when vLLM holds the request in WAITING_FOR_REMOTE_KVS and expects it
    # in get_finished's "received" set; False for a load the forward waits for (sync).
    is_async: bool = False


@dataclass
class UMBPConnectorMetadata(KVConnectorMetadata):
    namespace: bytes = b""  # 16 bytes; keys are derived per TP rank by each worker
    group: int = 0  # the KV cache group the ops refer to
    loads: list[BlockOp] = field(default_factory=list)
    stores: list[BlockOp] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Finished requests whose free the scheduler delayed because some of their stores were
    # still in flight: each worker reports them as "finished sending" once its stores for
    # them are done (and only them: a report for a request whose blocks vLLM already freed
    # would break the scheduler).
    finish_after_stores: list[str] = field(default_factory=list)


@dataclass
class UMBPWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers finished since their last report (summed over TP ranks).

    `store_done`: request id -> number of its store ops whose outcome is known (stored,
    present, refused or not submitted); the scheduler compares it with the ops it planned
    to decide whether a finished request's blocks can be freed at once.
    `stored`: block hash -> number of ranks that now hold it in the pool (for KV events).
    """

    store_done: dict[str, int] = field(default_factory=dict)
    stored: dict[bytes, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, UMBPWorkerMetadata):
            for r, n in other.store_done.items():
                self.store_done[r] = self.store_done.get(r, 0) + n
            for h, n in other.stored.items():
                self.stored[h] = self.stored.get(h, 0) + n
        return self


# ---------------------------------------------------------------------------------------
# The connector
# ---------------------------------------------------------------------------------------


class UMBPStoreConnector(KVConnectorBase_V1):
    """vLLM KV connector for UMBP (both roles; the role picks the half that runs)."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._native = _load_native()
        ktc = self._kv_transfer_config
        self._cfg = UMBPConnectorConfig.from_extra_config(
            ktc.kv_connector_extra_config, self._native.default_socket_path
        )
        pc = vllm_config.parallel_config
        if pc.pipeline_parallel_size > 1:
            raise ValueError(
                "UMBPStoreConnector does not support pipeline parallelism "
                f"(pipeline_parallel_size={pc.pipeline_parallel_size}); use tensor or data "
                "parallelism"
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
        self._hash_block_size = int(
            getattr(kv_cache_config, "hash_block_size", None) or vllm_config.cache_config.block_size
        )
        self._tp_size = pc.tensor_parallel_size
        self._dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        self._engine_id = str(ktc.engine_id)
        self._do_store = bool(ktc.is_kv_producer)
        self._do_load = bool(ktc.is_kv_consumer)
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
            self._sched: _SchedulerSide | None = _SchedulerSide(self)
            self._worker: _WorkerSide | None = None
        else:
            self._sched = None
            self._worker = _WorkerSide(self)
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


# ---------------------------------------------------------------------------------------
# Scheduler half
# ---------------------------------------------------------------------------------------


@dataclass
class _ReqState:
    request: Any
    local_hit_tokens: int = 0  # num_computed_tokens passed to the last lookup
    pool_prefix_blocks: int = 0  # leading blocks present in the pool (all ranks) at lookup
    store_cursor: int = 0  # blocks [0, cursor) need no store (in pool, loaded or planned)
    store_ops: int = 0  # store ops planned (each goes to every TP rank)
    store_ops_done: int = 0  # completions reported by workers, summed over ranks
    async_load_pending: bool = False  # async load planned, completion not yet seen
    load_block_ids: tuple[int, ...] = ()  # blocks of the last planned load
    load_failed: bool = False  # a load failed: never offer hits again (no retry loops)

    @property
    def has_store(self) -> bool:
        return self.store_ops > 0


class _SchedulerSide:
    """Lookups, load/store planning and request lifetime, in the scheduler process."""

    _RETRY_ATTACH_S = 1.0

    def __init__(self, c: UMBPStoreConnector):
        self.c = c
        self.cfg = c._cfg
        self.n = c._native
        self.namespace = c._base_namespace
        self._epoch = 0  # bumped by reset_cache: a new namespace makes old objects unreachable
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[BlockOp] = []
        self._finish_after_stores: list[str] = []
        # Events: stored-hash bookkeeping until every TP rank confirmed the store.
        self._event_pending: dict[bytes, tuple[Any, int]] = {}  # hash -> (BlockStored, ranks)
        self._events: list[Any] = []
        # One index per TP rank in embedded mode (each worker has a pool); one in standalone.
        self._index_paths: list[str] = []
        if self.cfg.embedded:
            default = self.n.default_socket_path()
            self._index_paths = [
                embedded_socket_path(default, c._engine_id, c._dp_rank, r)
                for r in range(c._tp_size)
            ]
        else:
            assert self.cfg.lookup_instance is not None
            self._index_paths = [self.cfg.lookup_instance]
        self._indexes: list[Any | None] = [None] * len(self._index_paths)
        self._next_attach = 0.0
        self._attach_backoff = self._RETRY_ATTACH_S
        if self.c._do_load and self.cfg.enable_lookup:
            self._attach(startup=True)

    # -- index attachment -------------------------------------------------------------
    def _attach(self, startup: bool = False) -> bool:
        """Attach missing indexes; True when all are attached.

        Standalone: the pool must be there at startup (error naming the socket). Embedded:
        the workers' pools exist before the scheduler's connector is built (vLLM creates the
        workers and their connectors first), so a normal attach works; if a pool is not
        there (yet), a lazy index (timeout 0) attaches whenever it is, missing meanwhile.
        """
        now = time.monotonic()
        if not startup and now < self._next_attach:
            return all(i is not None for i in self._indexes)
        self._next_attach = now + self._RETRY_ATTACH_S
        strict = startup and not self.cfg.embedded
        timeout = self.cfg.startup_timeout_ms if strict else self.cfg.lookup_timeout_ms
        for i, path in enumerate(self._index_paths):
            if self._indexes[i] is not None:
                continue
            try:
                self._indexes[i] = self.n.Index(path, namespace=self.c._base_namespace, timeout_ms=timeout)
                continue
            except Exception as e:  # noqa: BLE001 - UmbpError / OSError
                if strict:
                    raise RuntimeError(
                        f"UMBP: cannot attach to the standalone pool's index at {path!r}: {e}. "
                        "Start `umbp-pool` there, or set kv_connector_extra_config "
                        "'endpoint'/'lookup_instance' or UMBP_STANDALONE_ADDRESS."
                    ) from e
                logger.warning("UMBP: index at %s not attached yet (%s); lookups miss", path, e)
            try:  # never blocks, never fails: attaches when the pool is reachable
                self._indexes[i] = self.n.Index(path, namespace=self.c._base_namespace, timeout_ms=0)
            except Exception as e:  # noqa: BLE001
                logger.debug("UMBP: lazy index for %s: %s", path, e)
                return False
        return True

    def _reattach(self, rank: int) -> None:
        """Replace a disconnected index by a fresh attachment (rate-limited, backing off).

        A restarted pool is a new process with a new index memfd, so the old mapping can
        never see new objects; the old handle is kept until a new one attaches.
        """
        now = time.monotonic()
        if now < self._next_attach:
            return
        i = rank if self.cfg.embedded else 0
        try:
            self._indexes[i] = self.n.Index(
                self._index_paths[i],
                namespace=self.c._base_namespace,
                timeout_ms=self.cfg.lookup_timeout_ms,
            )
            self._attach_backoff = self._RETRY_ATTACH_S
            logger.info("UMBP: re-attached the index at %s", self._index_paths[i])
        except Exception as e:  # noqa: BLE001
            self._attach_backoff = min(self._attach_backoff * 2, 10.0)
            logger.debug("UMBP: index at %s not back yet: %s", self._index_paths[i], e)
        self._next_attach = now + self._attach_backoff

    def _rank_index(self, rank: int) -> Any | None:
        return self._indexes[rank] if self.cfg.embedded else self._indexes[0]

    def _hashes(self, request: "Request") -> list[bytes]:
        return kv_block_hashes(request.block_hashes, self.c._hash_block_size, self.c._block_size)

    def _pool_prefix(self, hashes: list[bytes]) -> int:
        """Leading blocks present in the pool for every TP rank (0 when not attached)."""
        if not hashes:
            return 0
        if not all(i is not None for i in self._indexes) and not self._attach():
            return 0
        n = len(hashes)
        ns, g = self.namespace, self.c._group
        for rank in range(self.c._tp_size):
            idx = self._rank_index(rank)
            if idx is None:
                return 0
            keys = make_keys(self.n, ns, g, rank, hashes[:n])
            try:
                m = int(idx.match_prefix(keys))
            except Exception as e:  # noqa: BLE001 - never fail a lookup
                logger.debug("UMBP: match_prefix failed (%s); treating as a miss", e)
                m = 0
            if m == 0 and not getattr(idx, "connected", True):
                # The pool died or restarted (a restarted pool has a new index memfd):
                # misses until an index attaches again.
                self._reattach(rank)
            n = min(n, m)
            if n == 0:
                break
        return n

    # -- vLLM hooks ---------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request)
        st.local_hit_tokens = num_computed_tokens
        st.pool_prefix_blocks = 0
        if not (self.c._do_load and self.cfg.enable_lookup) or st.load_failed:
            # After a failed load the request recomputes: a pool that keeps failing (or an
            # index that keeps claiming an object it cannot deliver) must not make vLLM
            # retry the same load forever.
            return 0, False
        bs = self.c._block_size
        hashes = self._hashes(request)
        stats = self.c._stats
        stats.add("lookups", 1)
        stats.add("lookup_query_tokens", max(0, request.num_tokens - num_computed_tokens))
        n = self._pool_prefix(hashes)
        st.pool_prefix_blocks = n
        # At least one token must be computed to sample the next one: a hit covering the
        # whole request is trimmed by one token (its block is still loaded in full).
        hit_tokens = min(n * bs, request.num_tokens - 1)
        ext = hit_tokens - num_computed_tokens
        if ext <= 0:
            return 0, False
        stats.add("lookup_hit_tokens", ext)
        # Async loads only for requests that never stored: a request that stored before a
        # preemption would otherwise have to report both "sent" and "received" at finish.
        is_async = self.cfg.load_async and not st.has_store
        return ext, is_async

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:  # lookups disabled or a resumed async request
            st = self._reqs[rid] = _ReqState(request)
        st.request = request
        if num_external_tokens <= 0:
            # No load (or the second call of an async load). Blocks already in the pool need
            # no store (first writer wins anyway).
            st.store_cursor = max(st.store_cursor, st.pool_prefix_blocks)
            return
        bs = self.c._block_size
        first = st.local_hit_tokens // bs
        last = math.ceil((st.local_hit_tokens + num_external_tokens) / bs)
        hashes = self._hashes(request)
        ids = list(blocks.get_block_ids()[self.c._group])
        if last > len(hashes) or last > len(ids):  # cannot happen per vLLM's contract
            logger.error("UMBP: load plan out of range for %s; not loading", rid)
            return
        # Async or not was decided by our own get_num_new_matched_tokens return value.
        is_async = self.cfg.load_async and not st.has_store
        self._pending_loads.append(BlockOp(rid, hashes[first:last], ids[first:last], is_async))
        st.store_cursor = max(st.store_cursor, last, st.pool_prefix_blocks)
        st.async_load_pending = is_async
        st.load_block_ids = tuple(ids[first:last])

    def build_connector_meta(self, so: "SchedulerOutput") -> UMBPConnectorMetadata:
        meta = UMBPConnectorMetadata(
            namespace=self.namespace,
            group=self.c._group,
            loads=self._pending_loads,
            preempted=sorted(so.preempted_req_ids or ()),
            finish_after_stores=self._finish_after_stores,
        )
        self._pending_loads = []
        self._finish_after_stores = []
        for rid in meta.preempted:
            st = self._reqs.get(rid)
            if st is not None:  # its blocks are gone; the next lookup re-plans
                st.store_cursor = 0
        if self.c._do_store:
            self._plan_stores(so, meta)
        return meta

    def _plan_stores(self, so: "SchedulerOutput", meta: UMBPConnectorMetadata) -> None:
        bs = self.c._block_size
        block_state = getattr(so, "kv_connector_block_state", None)
        spec = so.scheduled_spec_decode_tokens or {}
        for rid, n_sched in so.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            req = st.request
            # Tokens whose KV exists after this step (rejected draft tokens excluded).
            upto = req.num_computed_tokens + n_sched - len(spec.get(rid, ()))
            if not self.cfg.save_decode_cache:
                upto = min(upto, req.num_prompt_tokens)
            hashes = self._hashes(req)
            full = min(upto // bs, len(hashes))
            if full <= st.store_cursor:
                continue
            ids = None
            if block_state is not None:
                got = block_state.get_block_ids(rid)
                ids = got[self.c._group] if got is not None else None
            if ids is None and self.c._kv_cache_manager is not None:
                ids = self.c._kv_cache_manager.get_block_ids(rid)[self.c._group]
            if ids is None:
                continue
            full = min(full, len(ids))
            lo = st.store_cursor
            if full <= lo:
                continue
            meta.stores.append(BlockOp(rid, hashes[lo:full], list(ids[lo:full])))
            st.store_cursor = full
            st.store_ops += 1
            if self.c._events_enabled:
                self._remember_for_events(req, hashes, lo, full)

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.async_load_pending:
            # An async load may still write the blocks; the worker's "finished receiving"
            # report (which vLLM handles for finished requests too) releases them.
            # (Requests that ever stored never load asynchronously, so no store is pending.)
            return True, None
        if st.store_ops_done < st.store_ops * self.c._tp_size:
            # Stores may still read the blocks: keep them until every worker reports the
            # request as "finished sending" (it learns which ones through the metadata).
            self._finish_after_stores.append(request.request_id)
            return True, None
        return False, None

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        bad = out.invalid_block_ids
        if bad:
            for st in self._reqs.values():
                if st.load_block_ids and not bad.isdisjoint(st.load_block_ids):
                    st.load_failed = True
        for rid in out.finished_recving or ():
            st = self._reqs.get(rid)
            if st is not None:
                st.async_load_pending = False
        wm = out.kv_connector_worker_meta
        if isinstance(wm, UMBPWorkerMetadata):
            for rid, n in wm.store_done.items():
                st = self._reqs.get(rid)
                if st is not None:
                    st.store_ops_done += n
            for h, ranks in wm.stored.items():
                pending = self._event_pending.get(h)
                if pending is None:
                    continue
                ev, seen = pending
                seen += ranks
                if seen >= self.c._tp_size:
                    del self._event_pending[h]
                    self._events.append(ev)
                else:
                    self._event_pending[h] = (ev, seen)

    def _remember_for_events(self, req: Any, hashes: list[bytes], lo: int, hi: int) -> None:
        """Prepare BlockStored events, published once all TP ranks stored the block."""
        if len(self._event_pending) > 65536:  # never grow without bound
            self._event_pending.clear()
        try:
            from vllm.distributed.kv_events import BlockStored
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            bs = self.c._block_size
            tokens = req.all_token_ids
            for b in range(lo, hi):
                ev = BlockStored(
                    block_hashes=[maybe_convert_block_hash(hashes[b])],
                    parent_block_hash=maybe_convert_block_hash(hashes[b - 1]) if b else None,
                    token_ids=list(tokens[b * bs : (b + 1) * bs]),
                    block_size=bs,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                    group_idx=self.c._group,
                )
                self._event_pending[hashes[b]] = (ev, 0)
        except Exception as e:  # noqa: BLE001 - events are best effort
            logger.debug("UMBP: cannot build KV events: %s", e)

    def take_events(self) -> list[Any]:
        ev, self._events = self._events, []
        return ev

    def reset_cache(self) -> bool:
        """Make everything stored so far unreachable for this engine.

        The pool may be shared (standalone) and first-writer-wins, so objects are not
        deleted: the engine switches to a new namespace (old objects age out by LRU).
        Used by vLLM after weight updates, where stale KV must never be reused.
        """
        self._epoch += 1
        self.namespace = bytes(
            self.n.namespace_digest(f"{self.c._ns_text}#reset-epoch={self._epoch}")
        )
        self._event_pending.clear()
        for st in self._reqs.values():
            st.pool_prefix_blocks = 0
        logger.info("UMBP: reset_cache -> namespace %s", self.namespace.hex())
        return True

    def shutdown(self) -> None:
        self._indexes = [None] * len(self._index_paths)


# ---------------------------------------------------------------------------------------
# Worker half
# ---------------------------------------------------------------------------------------


@dataclass
class _Job:
    kind: str  # "load" | "store"
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    t0: int  # perf_counter_ns at submit
    sync: bool = False  # a load the current step's forward waits for


class _WorkerSide:
    """Pool attachment, KV registration and transfer submission/reaping in a worker."""

    def __init__(self, c: UMBPStoreConnector):
        self.c = c
        self.cfg = c._cfg
        self.n = c._native
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - TP group not initialised: single rank
            self.tp_rank = 0
        self.pool = None
        if self.cfg.embedded:
            path = embedded_socket_path(
                self.n.default_socket_path(), c._engine_id, c._dp_rank, self.tp_rank
            )
            cap = self.cfg.capacity_per_worker(c._tp_size)
            try:
                self.pool = self.n.EmbeddedPool(
                    cap,
                    socket_path=path,
                    high_wm=self.cfg.dram_high_watermark,
                    low_wm=self.cfg.dram_low_watermark,
                )
            except Exception as e:
                raise RuntimeError(
                    f"UMBP: cannot start the embedded pool ({cap} bytes) on {path!r}: {e}"
                ) from e
            self.endpoint = str(self.pool.socket_path)
            logger.info("UMBP: embedded pool of %d bytes listening on %s", cap, self.endpoint)
        else:
            assert self.cfg.endpoint is not None
            self.endpoint = self.cfg.endpoint
        try:
            self.w = self.n.Worker(
                self.endpoint,
                c._base_namespace,
                tp_rank=self.tp_rank,
                tp_size=c._tp_size,
                dp_rank=c._dp_rank,
                timeout_ms=self.cfg.timeout_ms,
                startup_timeout_ms=self.cfg.startup_timeout_ms,
            )
        except Exception as e:
            if self.pool is not None:
                self.pool.close()
            raise RuntimeError(
                f"UMBP: cannot reach the pool at {self.endpoint!r} within "
                f"{self.cfg.startup_timeout_ms} ms: {e}"
                + (
                    ". Start `umbp-pool` there, or set kv_connector_extra_config 'endpoint' "
                    "or UMBP_STANDALONE_ADDRESS."
                    if not self.cfg.embedded
                    else ""
                )
            ) from e
        self.object_bytes = 0
        self._registered = False
        self._jobs: dict[int, _Job] = {}
        self._sync_loads: list[int] = []  # transfer ids the current forward waits for
        self._req_stores: dict[str, set[int]] = {}  # in-flight store transfers per request
        self._finishing: set[str] = set()  # finished requests whose free waits for our stores
        self._store_done: dict[str, int] = {}  # store ops with a known outcome, per request
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._stored_hashes: dict[bytes, int] = {}

    # -- registration -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the paged KV memory once, and describe one segment per layer page.

        CPU engine (LBHNC): every layer tensor is a (num_blocks, kv_heads, block_size,
        2*head_size) view into one buffer. The buffer is registered once as host memory
        (the pool reads/writes it with process_vm_readv/writev); layer L is the segment
        (alloc, offset of the view, stride(0) * element size, page bytes, num_blocks).
        GPU tensors are registered through CUDA IPC instead; segments are the same.
        Older layouts with a leading K/V axis of 2 become two segments per layer.
        """
        kcc = self.c._kv_cache_config
        num_blocks = int(kcc.num_blocks)
        names = [n for n in kcc.kv_cache_groups[self.c._group].layer_names if n in kv_caches]
        if not names:
            raise ValueError("UMBP: none of the KV cache group's layers were registered")
        allocs: dict[tuple[str, int], tuple[int, int]] = {}  # (device, base) -> (alloc id, base)
        segments: list[tuple[int, int, int, int, int]] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name in names:
            t = kv_caches[name]
            key = (t.data_ptr(), tuple(t.shape))
            if key in seen:  # a layer sharing another layer's KV: one copy suffices
                continue
            seen.add(key)
            alloc_id, base = self._register_storage(t, allocs)
            for v in _block_views(t, num_blocks, name):
                es = v.element_size()
                page = _dense_page_elems(v, name) * es
                stride = v.stride(0) * es
                if stride < page:
                    raise ValueError(
                        f"UMBP: layer {name}: blocks overlap (stride {stride} < page {page})"
                    )
                segments.append((alloc_id, v.data_ptr() - base, stride, page, int(v.shape[0])))
        self.object_bytes = int(self.w.register_layout(self.c._group, segments))
        self._registered = True
        logger.info(
            "UMBP: registered %d layer segment(s), %d allocation(s), %d bytes per block "
            "object (tp_rank %d)",
            len(segments),
            len(allocs),
            self.object_bytes,
            self.tp_rank,
        )

    def _register_storage(
        self, t: torch.Tensor, allocs: dict[tuple[str, int], tuple[int, int]]
    ) -> tuple[int, int]:
        st = t.untyped_storage()
        base, size = int(st.data_ptr()), int(st.nbytes())
        k = (str(t.device), base)
        if k not in allocs:
            if t.device.type == "cpu":
                alloc_id = self.w.register_host_memory(base, size)
            elif t.device.type == "cuda":
                alloc_id = self.w.register_cuda_memory(base, size, t.device.index or 0)
            else:
                raise ValueError(f"UMBP: KV cache on unsupported device {t.device}")
            allocs[k] = (int(alloc_id), base)
        return allocs[k]

    # -- per-step -----------------------------------------------------------------------
    def on_metadata(self, meta: UMBPConnectorMetadata) -> None:
        # Recorded at bind time, so the "finished sending" report always matches the
        # scheduler's delayed free, whatever happens later in the step.
        self._finishing.update(meta.finish_after_stores)

    def _keys(self, meta: UMBPConnectorMetadata, hashes: list[bytes]) -> list[bytes]:
        return make_keys(self.n, meta.namespace, meta.group, self.tp_rank, hashes)

    def handle_preemptions(self, meta: UMBPConnectorMetadata) -> None:
        """Preempted requests' blocks are reused right after: finish their stores first."""
        for rid in meta.preempted:
            for tid in list(self._req_stores.get(rid, ())):
                res = self._wait(tid)
                if res is None:
                    logger.warning(
                        "UMBP: store %d of preempted request %s still pending after %d ms",
                        tid,
                        rid,
                        self.cfg.timeout_ms,
                    )

    def start_load_kv(self, meta: UMBPConnectorMetadata) -> None:
        for op in meta.loads:
            if not op.block_ids:
                continue
            job = _Job(
                "load", op.req_id, op.hashes, op.block_ids, time.perf_counter_ns(), sync=not op.is_async
            )
            self.c._stats.add("load_ops", 1)
            self.c._stats.add("load_blocks", len(op.block_ids))
            try:
                if not self._registered:
                    raise RuntimeError("KV caches not registered")
                tid = int(self.w.load(meta.group, self._keys(meta, op.hashes), op.block_ids))
            except Exception as e:  # noqa: BLE001 - pool gone: recompute
                logger.warning("UMBP: load for %s not submitted (%s); recomputing", op.req_id, e)
                self._finish_load(job, None)
                continue
            self._jobs[tid] = job
            if job.sync:
                self._sync_loads.append(tid)

    def wait_for_sync_loads(self) -> None:
        """Block until this step's synchronous loads are done (at most timeout_ms each).

        The pool writes whole objects (all layers of a block), so the first layer's wait
        covers every layer; later calls return at once.
        """
        while self._sync_loads:
            tid = self._sync_loads.pop()
            job = self._jobs.pop(tid, None)
            if job is None:
                continue
            res = self._wait(tid)
            if res is None:
                logger.warning(
                    "UMBP: load %d for %s pending after %d ms; recomputing its blocks",
                    tid,
                    job.req_id,
                    self.cfg.timeout_ms,
                )
            self._finish_load(job, res)

    def wait_for_save(self, meta: UMBPConnectorMetadata) -> None:
        # Synchronous loads not waited for by an attention layer still finish this step, so
        # their errors are reported in the step that used them.
        self.wait_for_sync_loads()
        for op in meta.stores:
            if not op.block_ids:
                continue
            job = _Job("store", op.req_id, op.hashes, op.block_ids, time.perf_counter_ns())
            self.c._stats.add("store_ops", 1)
            self.c._stats.add("store_blocks", len(op.block_ids))
            try:
                if not self._registered:
                    raise RuntimeError("KV caches not registered")
                tid = int(self.w.store(meta.group, self._keys(meta, op.hashes), op.block_ids))
            except Exception as e:  # noqa: BLE001 - pool gone / refusing: not stored
                logger.debug("UMBP: store for %s not submitted: %s", op.req_id, e)
                self.c._stats.add("store_not_stored_blocks", len(op.block_ids))
                self._store_done[op.req_id] = self._store_done.get(op.req_id, 0) + 1
                continue
            self._jobs[tid] = job
            self._req_stores.setdefault(op.req_id, set()).add(tid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # `finished_req_ids` is not needed: the scheduler names the requests whose free it
        # delayed (metadata.finish_after_stores); others have no store in flight.
        self._reap()
        for rid in finished_req_ids:
            if rid not in self._finishing and not self._req_stores.get(rid):
                self._req_stores.pop(rid, None)
        sending = {rid for rid in self._finishing if not self._req_stores.get(rid)}
        for rid in sending:
            self._finishing.discard(rid)
            self._req_stores.pop(rid, None)
        recving, self._finished_recving = self._finished_recving, set()
        return (sending or None), (recving or None)

    def take_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def take_worker_meta(self) -> UMBPWorkerMetadata | None:
        if not self._stored_hashes and not self._store_done:
            return None
        meta = UMBPWorkerMetadata(store_done=self._store_done, stored=self._stored_hashes)
        self._stored_hashes, self._store_done = {}, {}
        return meta

    # -- completions --------------------------------------------------------------------
    def _wait(self, tid: int) -> list[int] | None:
        """Wait for one transfer; on completion dispatch it and return its statuses."""
        try:
            res = self.w.wait(tid, self.cfg.timeout_ms)
        except Exception as e:  # noqa: BLE001 - treat as failed
            logger.warning("UMBP: wait(%d) failed: %s", tid, e)
            res = []
        if res is None:
            return None
        job = self._jobs.get(tid)
        if job is not None and job.kind == "store":
            self._jobs.pop(tid, None)
            self._finish_store(tid, job, list(res))
        return list(res)

    def _reap(self) -> None:
        try:
            done = self.w.poll()
        except Exception as e:  # noqa: BLE001
            logger.debug("UMBP: poll failed: %s", e)
            done = []
        for tid, statuses in done:
            job = self._jobs.pop(int(tid), None)
            if job is None:
                continue  # abandoned (timed-out synchronous load) or already handled
            if job.kind == "store":
                self._finish_store(int(tid), job, list(statuses))
            else:
                if job.sync and int(tid) in self._sync_loads:
                    self._sync_loads.remove(int(tid))
                self._finish_load(job, list(statuses))

    def _finish_load(self, job: _Job, statuses: list[int] | None) -> None:
        ok = self.n.STATUS_LOADED
        st = statuses if statuses is not None else []
        failed = [
            b for i, b in enumerate(job.block_ids) if i >= len(st) or st[i] != ok
        ]
        # A failed block invalidates everything after it in the request (vLLM truncates
        # at the first invalid block), but reporting exactly the failed ones is enough.
        self._load_errors.update(failed)
        stats = self.c._stats
        stats.add("load_failed_blocks", len(failed))
        good = len(job.block_ids) - len(failed)
        stats.add("load_bytes", good * self.object_bytes)
        stats.add("load_ns", time.perf_counter_ns() - job.t0)
        if not job.sync:
            self._finished_recving.add(job.req_id)

    def _finish_store(self, tid: int, job: _Job, statuses: list[int]) -> None:
        n = self.n
        stored = present = 0
        for i, h in enumerate(job.hashes):
            s = statuses[i] if i < len(statuses) else None
            if s == n.STATUS_STORED:
                stored += 1
            elif s == n.STATUS_ALREADY_PRESENT:
                present += 1
            else:
                continue
            if self.c._events_enabled:
                self._stored_hashes[h] = self._stored_hashes.get(h, 0) + 1
        stats = self.c._stats
        stats.add("store_stored_blocks", stored)
        stats.add("store_present_blocks", present)
        stats.add("store_not_stored_blocks", len(job.hashes) - stored - present)
        stats.add("store_bytes", stored * self.object_bytes)
        stats.add("store_ns", time.perf_counter_ns() - job.t0)
        self._store_done[job.req_id] = self._store_done.get(job.req_id, 0) + 1
        pending = self._req_stores.get(job.req_id)
        if pending is not None:
            pending.discard(tid)

    def shutdown(self) -> None:
        # Give in-flight stores a bounded chance to land; blocks are released by vLLM next.
        deadline = time.monotonic() + self.cfg.timeout_ms / 1000
        while any(j.kind == "store" for j in self._jobs.values()) and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.005)
        for closer in (getattr(self, "w", None), self.pool):
            if closer is None:
                continue
            try:
                closer.close()
            except Exception as e:  # noqa: BLE001
                logger.debug("UMBP: close failed: %s", e)
        self.pool = None


# ---------------------------------------------------------------------------------------
# Layout helpers
# ---------------------------------------------------------------------------------------


def _block_views(t: torch.Tensor, num_blocks: int, name: str) -> list[torch.Tensor]:
    """Per-layer tensor -> views whose dim 0 is the block index."""
    if t.dim() >= 2 and t.shape[0] == num_blocks:
        return [t]
    if t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return [t[0], t[1]]  # (2, num_blocks, ...): K and V pages
    raise ValueError(
        f"UMBP: layer {name}: unsupported KV cache shape {tuple(t.shape)} "
        f"(expected ({num_blocks}, ...) or (2, {num_blocks}, ...))"
    )


def _dense_page_elems(v: torch.Tensor, name: str) -> int:
    """Elements of one block; raise unless each block is one dense (maybe permuted) page."""
    dims = [(v.stride(i), v.shape[i]) for i in range(1, v.dim()) if v.shape[i] != 1]
    expected = 1
    for stride, size in sorted(dims):
        if stride != expected:
            raise ValueError(
                f"UMBP: layer {name}: a block is not one contiguous page "
                f"(shape {tuple(v.shape)}, stride {tuple(v.stride())}); this KV layout "
                "is not supported"
            )
        expected *= size
    return expected
