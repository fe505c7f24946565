"""The connector's scheduler half: prefix lookups, load/store planning, request lifetime
and KV events, in the engine's scheduler process.

Lookups read the pool's shared-memory index (`umbp._native.Index`): no RPC, never blocks,
a dead pool is a miss. The scheduler never waits on the pool after startup: an index whose
pool died re-attaches by itself (`IndexClient` dials without waiting, lookup by lookup),
and a missing index is created lazily (timeout 0). Each step's plan goes to every worker as `UMBPConnectorMetadata`;
the workers' answers come back as `UMBPWorkerMetadata`.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._logging import get_logger
from .endpoints import embedded_socket_path
from .keys import kv_block_hashes, make_keys
from .metadata import BlockOp, UMBPConnectorMetadata, UMBPWorkerMetadata

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .connector import UMBPStoreConnector

logger = get_logger("scheduler")

# Bounds on event bookkeeping: events are advisory and must never grow memory unbounded.
_MAX_EVENT_PENDING = 1 << 16


@dataclass
class ReqState:
    request: Any
    local_hit_tokens: int = 0  # num_computed_tokens passed to the last lookup
    pool_prefix_blocks: int = 0  # leading blocks present in the pool (all ranks) at lookup
    store_cursor: int = 0  # blocks [0, cursor) need no store (in pool, loaded or planned)
    store_ops: int = 0  # store ops planned (each goes to every TP rank)
    store_ops_done: int = 0  # completions reported by workers, summed over ranks
    async_load_pending: bool = False  # async load planned, completion not yet seen
    load_block_ids: tuple[int, ...] = ()  # blocks of the last planned load
    load_first: int = 0  # index (in the request) of that load's first block
    load_failed: bool = False  # a load failed: never offer hits again (no retry loops)

    @property
    def has_store(self) -> bool:
        return self.store_ops > 0


class SchedulerSide:
    _RETRY_ATTACH_S = 1.0

    def __init__(self, c: "UMBPStoreConnector"):
        self.c = c
        self.cfg = c._cfg
        self.n = c._native
        self.namespace = c._base_namespace
        self._epoch = 0  # bumped by reset_cache
        self._reset_pending = False  # tell the workers to drop our objects next step
        self._reqs: dict[str, ReqState] = {}
        self._pending_loads: list[BlockOp] = []
        self._finish_after_stores: list[str] = []
        self._events: list[Any] = []
        # BlockStored events wait until every TP rank confirmed the store:
        # hash -> (event, ranks confirmed).
        self._event_pending: dict[bytes, tuple[Any, int]] = {}
        # Pool events name object keys; vLLM's events name block hashes. Keys of every rank
        # of every block we announced (or are about to) map back to the hash.
        self._key_to_hash: dict[bytes, bytes] = {}
        self._block_keys: dict[bytes, list[bytes]] = {}  # hash -> its keys (all ranks)
        self._published: OrderedDict[bytes, None] = OrderedDict()  # BlockStored sent
        self._event_source_ok = True
        # One index per TP rank in embedded mode (each worker has a pool); one in standalone.
        if self.cfg.embedded:
            default = self.n.default_socket_path()
            self._index_paths = [
                embedded_socket_path(default, c._engine_id, c._dp_rank, r, lookup_dir=self.cfg.lookup_dir)
                for r in range(c._tp_size)
            ]
        else:
            assert self.cfg.lookup_instance is not None
            self._index_paths = [self.cfg.lookup_instance]
        self._indexes: list[Any | None] = [None] * len(self._index_paths)
        self._index_was_up = [False] * len(self._index_paths)
        self._next_attach = 0.0
        if (self.c._do_load and self.cfg.enable_lookup) or self.c._events_enabled:
            self._attach(startup=True)

    # -- index attachment -------------------------------------------------------------
    def _attach(self, startup: bool = False) -> bool:
        """Attach missing indexes; True when all are attached.

        Standalone: the pool must be there at startup (error naming the socket). Embedded:
        the workers' pools exist before the scheduler's connector is built (vLLM creates the
        workers and their connectors first), so a normal attach works; if a pool is not
        there (yet), a lazy index (timeout 0) attaches whenever it is, missing meanwhile.
        After startup nothing here waits: only lazy indexes are created.
        """
        now = time.monotonic()
        if not startup and now < self._next_attach:
            return all(i is not None for i in self._indexes)
        self._next_attach = now + self._RETRY_ATTACH_S
        strict = startup and not self.cfg.embedded
        timeout = self.cfg.startup_timeout_ms if strict else self.cfg.lookup_timeout_ms
        # Only at startup may an attach wait (the engine is not serving yet); later, only
        # lazy indexes (below) are created: the scheduler never waits on a pool.
        for i, path in enumerate(self._index_paths if startup else ()):
            if self._indexes[i] is not None:
                continue
            try:
                self._indexes[i] = self.n.Index(path, namespace=self.c._base_namespace, timeout_ms=timeout, pool_uid=self.cfg.pool_uid)
            except Exception as e:  # noqa: BLE001 - UmbpError / OSError
                if strict:
                    raise RuntimeError(
                        f"UMBP: cannot attach to the standalone pool's index at {path!r}: {e}. "
                        "Start `umbp-pool` there, or set kv_connector_extra_config "
                        "'endpoint'/'lookup_instance' or UMBP_STANDALONE_ADDRESS."
                    ) from e
                logger.warning("UMBP: index at %s not attached yet (%s); lookups miss", path, e)
        for i, path in enumerate(self._index_paths):
            if self._indexes[i] is not None:
                continue
            try:  # never blocks, never fails: attaches when the pool is reachable
                self._indexes[i] = self.n.Index(path, namespace=self.c._base_namespace, timeout_ms=0, pool_uid=self.cfg.pool_uid)
            except Exception as e:  # noqa: BLE001
                logger.debug("UMBP: lazy index for %s: %s", path, e)
                return False
        return True

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
            try:
                # Keys derived inside the binding when it can (no key objects per block).
                if hasattr(idx, "match_hashes"):
                    m = int(idx.match_hashes(ns, g, rank, hashes[:n]))
                else:
                    m = int(idx.match_prefix(make_keys(self.n, ns, g, rank, hashes[:n])))
            except Exception as e:  # noqa: BLE001 - never fail a lookup
                logger.debug("UMBP: match_prefix failed (%s); treating as a miss", e)
                m = 0
            # A pool that died or restarted (a restarted pool has a new index memfd) is a
            # miss: the index notices and re-attaches by itself, without waiting, on a
            # later lookup. Building a new Index here would wait on the pool.
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
            st = self._reqs[request.request_id] = ReqState(request)
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
            st = self._reqs[rid] = ReqState(request)
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
        # Same decision as our get_num_new_matched_tokens told vLLM.
        is_async = self.cfg.load_async and not st.has_store
        self._pending_loads.append(BlockOp(rid, hashes[first:last], ids[first:last], is_async))
        st.store_cursor = max(st.store_cursor, last, st.pool_prefix_blocks)
        st.async_load_pending = is_async
        st.load_block_ids = tuple(ids[first:last])
        st.load_first = first

    def build_connector_meta(self, so: "SchedulerOutput") -> UMBPConnectorMetadata:
        meta = UMBPConnectorMetadata(
            namespace=self.namespace,
            group=self.c._group,
            loads=self._pending_loads,
            preempted=sorted(so.preempted_req_ids or ()),
            finish_after_stores=self._finish_after_stores,
            reset_pool=self._reset_pending,
        )
        self._pending_loads = []
        self._finish_after_stores = []
        self._reset_pending = False
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
            if upto // bs <= st.store_cursor:
                continue  # most steps (decode): nothing newly full, skip the hashes
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
                    # vLLM recomputes from the first bad block; the recomputed blocks are
                    # not in the pool (that is why they failed), so they must be stored.
                    st.store_cursor = min(st.store_cursor, st.load_first)
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
                    self._publish(h)
                else:
                    self._event_pending[h] = (ev, seen)

    # -- KV events ----------------------------------------------------------------------
    def _remember_for_events(self, req: Any, hashes: list[bytes], lo: int, hi: int) -> None:
        """Prepare BlockStored events, published once all TP ranks stored the block."""
        if len(self._event_pending) > _MAX_EVENT_PENDING:
            for h in list(self._event_pending):
                self._forget(h)
        try:
            from vllm.distributed.kv_events import BlockStored
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            bs = self.c._block_size
            tokens = req.all_token_ids
            todo = [b for b in range(lo, hi) if hashes[b] not in self._published]
            # kv_event_max_objects: when the tracked blocks (announced or about to be)
            # fill it, new BlockStored events are suppressed until tracked blocks leave
            # the pool; storing and lookups go on.
            room = max(0, self.cfg.kv_event_max_objects - len(self._published) - len(self._event_pending))
            if len(todo) > room:
                if not getattr(self, "_events_full_logged", False):
                    self._events_full_logged = True
                    logger.warning(
                        "UMBP: kv_event_max_objects=%d blocks tracked: BlockStored events are "
                        "suppressed until tracked blocks leave the pool",
                        self.cfg.kv_event_max_objects,
                    )
                self.c._stats.add("events_suppressed", len(todo) - room)
                todo = todo[:room]
            # Keys as the workers will derive them (this step's namespace, every rank), so
            # that the pool's "removed" events can be named by block hash.
            rank_keys = [
                make_keys(self.n, self.namespace, self.c._group, r, [hashes[b] for b in todo])
                for r in range(self.c._tp_size)
            ]
            for i, b in enumerate(todo):
                h = hashes[b]
                self._event_pending[h] = (
                    BlockStored(
                        block_hashes=[maybe_convert_block_hash(h)],
                        parent_block_hash=maybe_convert_block_hash(hashes[b - 1]) if b else None,
                        token_ids=list(tokens[b * bs : (b + 1) * bs]),
                        block_size=bs,
                        lora_id=None,
                        medium="CPU",
                        lora_name=None,
                        group_idx=self.c._group,
                    ),
                    0,
                )
                keys = [rk[i] for rk in rank_keys]
                self._block_keys[h] = keys
                for k in keys:
                    self._key_to_hash[k] = h
        except Exception as e:  # noqa: BLE001 - events are best effort
            logger.debug("UMBP: cannot build KV events: %s", e)

    def _publish(self, h: bytes) -> None:
        self._published[h] = None  # bounded by kv_event_max_objects (_remember_for_events)

    def _forget(self, h: bytes) -> None:
        self._event_pending.pop(h, None)
        self._published.pop(h, None)
        for k in self._block_keys.pop(h, ()):
            self._key_to_hash.pop(k, None)

    def _removed(self, h: bytes, out: list[Any]) -> None:
        """The pool dropped (one rank's copy of) block `h`: it can no longer be loaded."""
        if h in self._published:
            from vllm.distributed.kv_events import BlockRemoved
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            out.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h)], medium="CPU", group_idx=self.c._group
                )
            )
        self._forget(h)

    def _drain_pool_events(self, out: list[Any]) -> None:
        """Pool evictions and resets -> BlockRemoved for blocks we announced."""
        for i, idx in enumerate(self._indexes):
            if idx is None:
                continue
            take = getattr(idx, "take_events", None)
            if take is None:
                if self._event_source_ok:
                    self._event_source_ok = False
                    logger.warning(
                        "UMBP: this umbp._native has no Index.take_events; KV events will "
                        "not report pool evictions"
                    )
                continue
            try:
                events = take()
            except Exception as e:  # noqa: BLE001 - events are best effort
                logger.debug("UMBP: take_events failed: %s", e)
                continue
            for kind, key in events:
                if kind == "removed":
                    h = self._key_to_hash.get(bytes(key))
                    if h is not None:
                        self._removed(h, out)
            up = bool(getattr(idx, "connected", True))
            if self._index_was_up[i] and not up:
                # A dead pool took every object with it, and a restarted one starts empty.
                for h in list(self._published):
                    self._removed(h, out)
            self._index_was_up[i] = up

    def take_events(self) -> list[Any]:
        if self.c._events_enabled:
            self._drain_pool_events(self._events)
        ev, self._events = self._events, []
        return ev

    def reset_cache(self) -> bool:
        """Forget everything this engine stored, in the pool too.

        Used by vLLM after weight updates, where stale KV must never be reused. The workers
        drop the objects (`Worker.reset_namespace`: every object stored under this engine's
        base namespace, in every epoch) with the next step's metadata. The switch to a new
        key namespace takes effect at once, and also covers what the drop cannot: stores
        still in flight, objects pinned by a load, and a pool that is unreachable now.
        """
        self._epoch += 1
        self.namespace = bytes(
            self.n.namespace_digest(f"{self.c._ns_text}#reset-epoch={self._epoch}")
        )
        self._reset_pending = True
        for h in list(self._event_pending):
            self._forget(h)
        for st in self._reqs.values():
            st.pool_prefix_blocks = 0
        logger.info("UMBP: reset_cache -> namespace %s; dropping pooled objects", self.namespace.hex())
        return True

    def shutdown(self) -> None:
        self._indexes = [None] * len(self._index_paths)
