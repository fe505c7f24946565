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
from .groups import FULL, MAMBA, SLIDING, GroupInfo
from .keys import kv_block_hashes, make_keys
from .metadata import BlockOp, UMBPConnectorMetadata, UMBPWorkerMetadata
from .request_params import NO_CONTROL, Handoff, HandoffWait, RequestControl, request_control
from .tier_events import last_per_key, restamp, slowest_tier

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .connector_view import ConnectorView

logger = get_logger("scheduler")

# Bounds on event bookkeeping: events are advisory and must never grow memory unbounded.
_MAX_EVENT_PENDING = 1 << 16


@dataclass
class ReqState:
    request: Any
    local_hit_tokens: int = 0  # num_computed_tokens passed to the last lookup
    pool_hit_tokens: int = 0  # prefix tokens restorable from the pool (all ranks) at lookup
    stored_upto: int = 0  # tokens [0, stored_upto) need no store (in pool, loaded or planned)
    store_ops: int = 0  # request-held store ops planned (each goes to every KV rank)
    store_ops_done: int = 0  # completions reported by workers, summed over ranks
    async_load_pending: bool = False  # async load planned, completion not yet seen
    load_block_ids: tuple[int, ...] = ()  # blocks of the last planned load (all groups)
    load_first: int = 0  # first token of that load
    # Failed loads: until the request is preempted after its last failure it gets no pool
    # hit (vLLM re-runs the lookup at once after a failed async load; the same hit would
    # replay the same failing load); after _MAX_FAILED_LOADS it recomputes for good.
    load_failures: int = 0
    failed_at_preemptions: int = 0  # request.num_preemptions when the last load failed
    tail_stored: bool = False  # enable_partial_hash_hits: the prompt's partial block planned
    # kv_transfer_params: per-request control and the P/D handoff (request_params.py).
    control: RequestControl = NO_CONTROL
    handoff_wait: "HandoffWait | None" = None  # decode side: waiting for a handoff's blocks
    handoff_done: bool = False  # decode side: the handoff's blocks arrived or its bound passed


def _finished_with_error(request: Any) -> bool:
    try:
        from vllm.v1.request import RequestStatus
    except ImportError:  # pragma: no cover - vLLM without v1 request states
        return False
    return getattr(request, "status", None) == RequestStatus.FINISHED_ERROR


# Failed loads after which a request gets no pool hit again (no retry loops against a
# pool that keeps failing or an index that keeps claiming what it cannot deliver).
_MAX_FAILED_LOADS = 3

# Hybrid lookups walk down from the longest full-attention hit; bound the walk.
_MAX_HIT_PROBES = 64
# Hashes lazy offload stored or loaded recently (not offered again while remembered).
_MAX_LAZY_SEEN = 1 << 18
# Freed blocks whose tokens are kept for lazy-offload events (~0.5 KiB each at block 128).
_MAX_LAZY_INFO = 1 << 14

# KV events name a block by (KV cache group, block hash): the groups of a hybrid model
# share block hashes (a sliding-window block and a full-attention block of one prefix have
# the same hash), and each group's block is a pool object of its own.
BlockKey = tuple[int, bytes]
# One block to announce: (hash, parent hash, tokens, block size).
EventItem = tuple[bytes, "bytes | None", list[int], int]


class SchedulerSide:
    _RETRY_ATTACH_S = 1.0

    def __init__(self, c: "ConnectorView"):
        self.c = c
        self.cfg = c._cfg
        self.n = c._native
        self.namespace = c._base_namespace
        self._epoch = 0  # bumped by reset_cache
        self._reset_pending = False  # tell the workers to drop our objects next step
        self._reqs: dict[str, ReqState] = {}
        self._pending_loads: list[BlockOp] = []
        self._finish_after_stores: list[str] = []
        # Stores of blocks the request does not hold for us (sliding-window and Mamba
        # groups free blocks while the request runs; lazy offload stores free blocks):
        # pinned in vLLM's block pool until every KV rank (TP × PCP) reported the op done.
        self._next_op = 1
        self._pins: dict[int, tuple[list[Any], int]] = {}  # op id -> (blocks, ranks done)
        self._lazy_seen: OrderedDict[tuple[int, bytes], None] = OrderedDict()
        # lazy_offload: stores picked after a step's frees, sent with the next metadata.
        self._lazy_ops: list[BlockOp] = []
        # lazy_offload with events: (group, hash) -> (parent hash, tokens) of freed blocks.
        self._lazy_block_info: OrderedDict[BlockKey, tuple[bytes | None, list[int]]] = OrderedDict()
        self.lazy_stored_blocks = 0  # blocks lazy offload submitted (tests, measurements)
        self._events: list[Any] = []
        # Events name blocks by (group, hash) (BlockKey): every group's blocks are announced.
        # BlockStored events of our stores wait until every KV rank confirmed the store:
        # block -> (event, ranks confirmed).
        self._event_pending: dict[BlockKey, tuple[Any, int]] = {}
        # Pool events name object keys; vLLM's events name block hashes. Keys of every rank
        # of every block we announced (or are about to) map back to the block.
        self._key_to_hash: dict[bytes, BlockKey] = {}
        self._block_keys: dict[BlockKey, list[bytes]] = {}  # block -> its keys (all ranks)
        self._published: OrderedDict[BlockKey, None] = OrderedDict()  # BlockStored sent
        # Tiers (tier_events.py): each key's tier as the pool's events said (absent: DRAM),
        # and each announced block's BlockStored with the tier it was announced for.
        self._key_tier: dict[bytes, str] = {}
        self._announced: dict[BlockKey, tuple[Any, str]] = {}
        self._event_source_ok = True
        # One index per KV rank in embedded mode (each worker has a pool: rank r is TP rank
        # r % tp_size of PCP rank r // tp_size, keys.kv_rank); one in standalone.
        if self.cfg.embedded:
            default = self.n.default_socket_path()
            tp = c._tp_size
            self._index_paths = [
                embedded_socket_path(default, c._engine_id, c._dp_rank, r % tp, lookup_dir=self.cfg.lookup_dir,
                                     instance=self.cfg.instance,
                                     pcp_rank=(r // tp) if c._pcp_size > 1 else None)
                for r in range(c._num_ranks)
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
                self._indexes[i] = self.n.Index(path, namespace=self.c._base_namespace, timeout_ms=timeout,
                                                pool_uid=self.cfg.pool_uid, stall_timeout_ms=self.cfg.lookup_timeout_ms)
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
                self._indexes[i] = self.n.Index(path, namespace=self.c._base_namespace, timeout_ms=0,
                                                pool_uid=self.cfg.pool_uid, stall_timeout_ms=self.cfg.lookup_timeout_ms)
            except Exception as e:  # noqa: BLE001
                logger.debug("UMBP: lazy index for %s: %s", path, e)
                return False
        return True

    def _rank_index(self, rank: int) -> Any | None:
        return self._indexes[rank] if self.cfg.embedded else self._indexes[0]

    # -- block hashes per group ---------------------------------------------------------
    def _hashes(self, request: "Request") -> list[bytes]:
        """The first full-attention group's hashes (single-group models: the only one)."""
        return kv_block_hashes(request.block_hashes, self.c._hash_block_size, self._g0.block_size)

    def _group_hashes(self, request: "Request", g: GroupInfo) -> list[bytes]:
        """Hash of each of the group's blocks (the hash of the prefix ending with it)."""
        return kv_block_hashes(request.block_hashes, self.c._hash_block_size, g.block_size)

    def _state_hash(self, request: "Request", tokens: int) -> bytes | None:
        """A Mamba state after `tokens` is keyed by the hash of the prefix ending there."""
        hb = self.c._hash_block_size
        if tokens <= 0 or tokens % hb or tokens // hb > len(request.block_hashes):
            return None
        return bytes(request.block_hashes[tokens // hb - 1])

    @property
    def _g0(self) -> GroupInfo:
        return next(g for g in self.c._groups if g.gid == self.c._group)

    @property
    def _hybrid(self) -> bool:
        return len(self.c._groups) > 1 or self.c._groups[0].kind != FULL

    def _pool_prefix(self, hashes: list[bytes], group: int | None = None) -> int:
        """Leading blocks present in the pool for every key rank (every TP rank of every PCP
        rank, or one per replica group where replicated KV is stored once; 0 when not
        attached)."""
        if not hashes:
            return 0
        if not all(i is not None for i in self._indexes) and not self._attach():
            return 0
        n = len(hashes)
        ns, g = self.namespace, (self.c._group if group is None else group)
        for rank in range(self.c._key_ranks):
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

    def _present(self, group: int, h: bytes) -> bool:
        """Object `h` of `group` is in the pool for every key rank (TP × PCP, or per replica
        group)."""
        for rank in range(self.c._key_ranks):
            idx = self._rank_index(rank)
            if idx is None:
                return False
            try:
                (key,) = make_keys(self.n, self.namespace, group, rank, [h])
                if not idx.contains(key):
                    return False
            except Exception as e:  # noqa: BLE001 - never fail a lookup
                logger.debug("UMBP: contains failed (%s); treating as a miss", e)
                return False
        return True

    def _group_has(self, request: "Request", g: GroupInfo, tokens: int, cache: dict) -> bool:
        """Everything group `g` needs to resume after a hit of `tokens` is in the pool."""
        if g.kind == MAMBA:
            h = self._state_hash(request, tokens)
            return h is not None and self._present(g.gid, h)
        hashes = cache.get(g.gid)
        if hashes is None:
            hashes = cache[g.gid] = self._group_hashes(request, g)
        need = g.needed_blocks(tokens)
        if need.stop > len(hashes):
            return False
        return all(self._present(g.gid, hashes[i]) for i in need)

    def _pool_hit_tokens(self, request: "Request", limit: int) -> int:
        """Hybrid models: the longest prefix (at most `limit` tokens, on the hit unit) that
        every group can restore from the pool."""
        if not all(i is not None for i in self._indexes) and not self._attach():
            return 0
        cache: dict[int, list[bytes]] = {}
        max_t = min(limit, len(request.block_hashes) * self.c._hash_block_size)
        for g in self.c._groups:
            if g.kind == FULL:
                cache[g.gid] = hashes = self._group_hashes(request, g)
                max_t = min(max_t, self._pool_prefix(hashes, g.gid) * g.block_size)
                if max_t <= 0:
                    return 0
        unit = self.c._hash_block_size if self.c._partial_hits else self.c._block_size
        others = [g for g in self.c._groups if g.kind != FULL]
        fulls = [g for g in self.c._groups if g.kind == FULL]
        if self.c._partial_hits and fulls:
            # enable_partial_hash_hits: the hit may end inside the full-attention block
            # after the prefix, where the pool holds that block as the tail of an earlier
            # prompt (keyed by the hash of the prefix ending at the tail).
            hb = self.c._hash_block_size
            bsz = fulls[0].block_size
            t = min(limit, len(request.block_hashes) * hb, max_t + bsz - 1) // hb * hb
            while t > max_t:
                h = self._state_hash(request, t)
                if (
                    t % bsz
                    and h is not None
                    and all(self._present(g.gid, h) for g in fulls)
                    and all(self._group_has(request, g, t, cache) for g in others)
                ):
                    return t
                t -= hb
        t = max_t // unit * unit
        for _ in range(_MAX_HIT_PROBES):
            if t <= 0:
                return 0
            if all(self._group_has(request, g, t, cache) for g in others):
                return t
            t -= unit
        return 0

    # -- vLLM hooks ---------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = ReqState(request, control=request_control(request))
        st.local_hit_tokens = num_computed_tokens
        st.pool_hit_tokens = 0
        if not (self.c._do_load and self.cfg.enable_lookup) or self._load_blocked(st, request):
            return 0, False
        ctl = st.control
        # A hit covering the whole request is trimmed by one token (vLLM computes at least
        # one); umbp.max_load_tokens caps it further.
        limit = request.num_tokens - 1
        if ctl.max_load_tokens is not None:
            limit = min(limit, ctl.max_load_tokens)
        # Every load is asynchronous when `_load_async` (load_async, or forced: Mamba, sparse
        # indexer, kv_load_failure_policy=recompute), a request that stored before included: it
        # looks up again only after a preemption, whose stores the workers finished or cancelled
        # before its blocks were reused (handle_preemptions), so at finish it reports "received"
        # or "sent", never both (request_finished).
        is_async = self.c._load_async
        stats = self.c._stats
        stats.add("lookups", 1)
        stats.add("lookup_query_tokens", max(0, request.num_tokens - num_computed_tokens))
        if self._hybrid:
            # The hit must be exact (a state or window resumes at exactly its end), and at
            # least one token must be computed to sample the next one.
            hit_tokens = self._pool_hit_tokens(request, limit)
            if self._handoff_pending(st, request, hit_tokens // self._g0.block_size):
                return None, False
            st.pool_hit_tokens = hit_tokens
            if self.c._events_enabled and hit_tokens > 0:
                self._announce_found(request, self._hit_blocks(request, hit_tokens))
        else:
            bs = self.c._block_size
            hashes = self._hashes(request)
            n = self._pool_prefix(hashes)
            if self._handoff_pending(st, request, n):
                return None, False
            if ctl.max_load_tokens is not None:
                n = min(n, ctl.max_load_tokens // bs)
            st.pool_hit_tokens = n * bs
            if self.c._events_enabled and n > 0:
                self._announce_found(request, [(self._g0, hashes, range(n))])
            # Trimmed by one token when it covers the whole request (its block is still
            # loaded in full).
            hit_tokens = min(n * bs, limit)
        ext = hit_tokens - num_computed_tokens
        if ext <= 0:
            return 0, False
        stats.add("lookup_hit_tokens", ext)
        return ext, is_async

    def _handoff_pending(self, st: ReqState, request: "Request", present_blocks: int) -> bool:
        """Decode side of a P/D handoff: True while the blocks the prefill engine stored
        for this request are not all in the pool yet and the handoff's bound has not
        passed (vLLM then skips the request this step and asks again: the scheduler never
        blocks). Over for good once the blocks are there or the bound passed (a timeout
        is a plain lookup: what is there is loaded, the rest recomputed)."""
        h = st.control.handoff
        if h is None or st.handoff_done:
            return False
        stats = self.c._stats
        if h.namespace != self.namespace.hex():
            st.handoff_done = True
            stats.add("pd_handoff_mismatches", 1)
            logger.warning(
                "UMBP: request %s carries a handoff from an engine with another key namespace "
                "(%s, this engine %s): its KV cannot be shared (different model or config); "
                "treated as a plain lookup",
                request.request_id, h.namespace, self.namespace.hex(),
            )
            return False
        want = min(h.blocks, (request.num_tokens - 1) // self._g0.block_size)
        if present_blocks >= want:
            st.handoff_done = True
            stats.add("pd_handoffs_received", 1)
            return False
        if st.handoff_wait is None:
            st.handoff_wait = HandoffWait(h)
        if st.handoff_wait.expired():
            st.handoff_done = True
            stats.add("pd_handoff_timeouts", 1)
            logger.warning(
                "UMBP: request %s: %d of the %d handed-off blocks in the pool after %d ms; "
                "the rest is recomputed",
                request.request_id, present_blocks, want, h.wait_ms,
            )
            return False
        stats.add("pd_handoff_waits", 1)
        return True

    @staticmethod
    def _load_blocked(st: ReqState, request: "Request") -> bool:
        """No pool hit for a request whose last load failed, until it was preempted since
        (its blocks are gone and it starts over: a new load is a new attempt, e.g. after a
        stalled pool recovered); none at all after _MAX_FAILED_LOADS failures. vLLM asks
        again right after a failed async load (the request is back in the waiting queue):
        that lookup misses, so the request recomputes instead of replaying the load."""
        if st.load_failures == 0:
            return False
        if st.load_failures >= _MAX_FAILED_LOADS:
            return True
        return int(getattr(request, "num_preemptions", 0)) <= st.failed_at_preemptions

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:  # lookups disabled or a resumed async request
            st = self._reqs[rid] = ReqState(request, control=request_control(request))
        st.request = request
        if num_external_tokens <= 0:
            # No load (or the second call of an async load). Blocks already in the pool need
            # no store (first writer wins anyway).
            st.stored_upto = max(st.stored_upto, st.pool_hit_tokens)
            return
        first_tok = st.local_hit_tokens
        end_tok = first_tok + num_external_tokens
        all_ids = blocks.get_block_ids()
        null = self._null_block_id()
        is_async = self.c._load_async
        ops: list[BlockOp] = []
        for g in self.c._groups:
            ids = list(all_ids[g.gid])
            need = g.needed_blocks(end_tok)
            lo = max(need.start, first_tok // g.block_size)
            if g.kind == MAMBA:
                h = self._state_hash(request, end_tok)
                if need.stop > len(ids) or h is None:
                    logger.error("UMBP: no state block for %s's load; not loading", rid)
                    ops = self._failing_load(rid, all_ids, first_tok, end_tok, is_async)
                    break
                if ids[need.stop - 1] != null:
                    ops.append(BlockOp(rid, [h], [ids[need.stop - 1]], is_async, group=g.gid))
                continue
            hashes = self._group_hashes(request, g)
            if g.kind == FULL and end_tok % g.block_size:
                # A partial hit: the last block is a prompt tail, keyed by its prefix hash.
                tail = self._state_hash(request, end_tok)
                hashes = hashes[: end_tok // g.block_size] + ([tail] if tail is not None else [])
            if need.stop > len(hashes) or need.stop > len(ids):  # cannot happen per vLLM
                logger.error("UMBP: load plan out of range for %s; not loading", rid)
                ops = self._failing_load(rid, all_ids, first_tok, end_tok, is_async)
                break
            pick = [i for i in range(lo, need.stop) if ids[i] != null]
            if pick:
                ops.append(
                    BlockOp(rid, [hashes[i] for i in pick], [ids[i] for i in pick], is_async, group=g.gid)
                )
        if is_async and not ops:
            # vLLM waits for this request's "received" report: an empty op makes the
            # workers send it.
            ops = [BlockOp(rid, [], [], True)]
        self._pending_loads.extend(ops)
        st.stored_upto = max(st.stored_upto, end_tok // self.c._block_size * self.c._block_size, st.pool_hit_tokens)
        st.async_load_pending = is_async and bool(ops)
        st.load_block_ids = tuple(b for op in ops for b in op.block_ids)
        st.load_first = first_tok
        if self.c._offload.lazy_offload:
            for op in ops:  # already in the pool: lazy offload need not store them again
                for h in op.hashes:
                    self._lazy_remember(op.group, h)

    def _failing_load(
        self, rid: str, all_ids: Any, first_tok: int, end_tok: int, is_async: bool
    ) -> list[BlockOp]:
        """A load that cannot be planned: its first group's blocks are "loaded" under keys
        the pool cannot hold, so the workers report them failed and vLLM recomputes them
        (never a hit whose bytes were not loaded)."""
        g = self._g0
        ids = list(all_ids[g.gid])[first_tok // g.block_size : -(-end_tok // g.block_size)]
        ids = [b for b in ids if b != self._null_block_id()]
        return [BlockOp(rid, [b""] * len(ids), ids, is_async, group=g.gid)]

    def _null_block_id(self) -> int:
        bp = self.c._gpu_block_pool
        nb = getattr(bp, "null_block", None) if bp is not None else None
        return int(nb.block_id) if nb is not None else 0

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
                st.stored_upto = 0
                if self.c._events_enabled and self.c._offload.lazy_offload and self.c._do_store:
                    self._note_lazy_blocks(st.request)  # its blocks went to the free queue
        if self.c._do_store:
            if self.c._offload.lazy_offload:
                self._plan_lazy_stores(meta)
            else:
                self._plan_stores(so, meta)
        return meta

    # -- stores -------------------------------------------------------------------------
    def _pinned_op(self, group: int, hashes: list[bytes], blocks: list[Any], rid: str) -> BlockOp | None:
        """A store of `blocks` (vLLM KVCacheBlocks) that pins them until every rank is done."""
        bp = self.c._gpu_block_pool
        if bp is None or not blocks:
            return None
        bp.touch(blocks)
        op_id = self._next_op
        self._next_op += 1
        self._pins[op_id] = (blocks, 0)
        return BlockOp(rid, hashes, [b.block_id for b in blocks], group=group, op_id=op_id)

    def has_pins(self) -> bool:
        return bool(self._pins)

    def _unpin(self, op_id: int, ranks: int) -> None:
        pin = self._pins.get(op_id)
        if pin is None:
            return
        blocks, done = pin
        done += ranks
        if done < self.c._num_ranks:
            self._pins[op_id] = (blocks, done)
            return
        del self._pins[op_id]
        bp = self.c._gpu_block_pool
        if bp is not None:
            bp.free_blocks(blocks)

    def _plan_stores(self, so: "SchedulerOutput", meta: UMBPConnectorMetadata) -> None:
        bs = self.c._block_size
        block_state = getattr(so, "kv_connector_block_state", None)
        spec = so.scheduled_spec_decode_tokens or {}
        for rid, n_sched in so.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None:
                continue
            if self._skips_save(st):
                continue
            req = st.request
            # Tokens whose KV exists after this step (rejected draft tokens excluded).
            upto = req.num_computed_tokens + n_sched - len(spec.get(rid, ()))
            if not self.cfg.save_decode_cache:
                upto = min(upto, req.num_prompt_tokens)
            if st.control.max_store_tokens is not None:
                upto = min(upto, st.control.max_store_tokens)
            if self.c._partial_hits and not st.tail_stored and upto >= req.num_prompt_tokens:
                self._plan_tail_store(st, block_state, meta)
            upto = min(upto, len(req.block_hashes) * self.c._hash_block_size) // bs * bs
            if upto <= st.stored_upto:
                continue  # most steps (decode): nothing newly full, skip the hashes
            ids = None
            if block_state is not None:
                ids = block_state.get_block_ids(rid)
            if ids is None and self.c._kv_cache_manager is not None:
                ids = self.c._kv_cache_manager.get_block_ids(rid)
            if ids is None:
                continue
            lo_tok = st.stored_upto
            null = self._null_block_id()
            for g in self.c._groups:
                if g.kind == MAMBA:
                    continue  # states come from vLLM's boundary hand-offs (below)
                gids = ids[g.gid]
                hashes = self._group_hashes(req, g)
                lo, hi = lo_tok // g.block_size, min(upto // g.block_size, len(hashes), len(gids))
                if hi <= lo:
                    continue
                if g.kind == FULL:
                    # The request holds these blocks until its stores are done
                    # (request_finished delays the free).
                    meta.stores.append(BlockOp(rid, hashes[lo:hi], list(gids[lo:hi]), group=g.gid))
                    st.store_ops += 1
                    if self.c._events_enabled:
                        self._remember_for_events(g, req, hashes, range(lo, hi))
                    continue
                # Sliding window: vLLM frees blocks that leave the window while the request
                # runs, so these are pinned instead. Only blocks vLLM itself cached under
                # the expected hash (their KV is complete) are stored.
                bp = self.c._gpu_block_pool
                if bp is None:
                    continue
                pick = [
                    i for i in range(lo, hi) if gids[i] != null and _cached_as(bp.blocks[gids[i]], hashes[i])
                ]
                op = self._pinned_op(g.gid, [hashes[i] for i in pick], [bp.blocks[gids[i]] for i in pick], rid)
                if op is not None:
                    meta.stores.append(op)
                    if self.c._events_enabled:
                        self._remember_for_events(g, req, hashes, pick)
            st.stored_upto = upto
        self._plan_state_stores(so, meta)

    @staticmethod
    def _skips_save(st: ReqState) -> bool:
        """umbp.skip_save: nothing of this request is stored (a request handed to a decode
        engine is stored anyway: the store is the handoff)."""
        return st.control.skip_save and not st.control.remote_decode

    def _plan_tail_store(self, st: ReqState, block_state: Any, meta: UMBPConnectorMetadata) -> None:
        """enable_partial_hash_hits: store the prompt's last, partial full-attention block,
        up to its last prefix-match-unit boundary, keyed by the hash of that prefix (a later
        prompt sharing exactly that prefix can then hit inside the block)."""
        st.tail_stored = True
        req = st.request
        hb = self.c._hash_block_size
        p = req.num_prompt_tokens // hb * hb
        h = self._state_hash(req, p)
        ids = block_state.get_block_ids(req.request_id) if block_state is not None else None
        if h is None or ids is None:
            return
        for g in self.c._groups:
            if g.kind != FULL or p % g.block_size == 0:
                continue
            k = p // g.block_size
            if k < len(ids[g.gid]):
                meta.stores.append(BlockOp(req.request_id, [h], [ids[g.gid][k]], group=g.gid))
                st.store_ops += 1
                if self.c._events_enabled:
                    self._remember_blocks(g, [self._state_item(req, p)])

    def _plan_state_stores(self, so: "SchedulerOutput", meta: UMBPConnectorMetadata) -> None:
        """Mamba "align" states vLLM hands off at block (or prefix-match-unit) boundaries."""
        block_state = getattr(so, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        bp = self.c._gpu_block_pool
        ours = {g.gid: g for g in self.c._groups if g.kind == MAMBA}
        if not offloads or bp is None or not ours:
            return
        gone = set(so.preempted_req_ids or ()) | set(getattr(so, "finished_req_ids", ()) or ())
        for rid, entries in offloads.items():
            st = self._reqs.get(rid)
            if st is None or rid in gone:
                continue  # its blocks may already belong to another request
            if self._skips_save(st):
                continue
            req = st.request
            for gid, block_id, boundary in entries:
                if gid not in ours:
                    continue
                if not self.cfg.save_decode_cache and boundary > req.num_prompt_tokens:
                    continue
                h = self._state_hash(req, boundary)
                if h is None:
                    continue
                op = self._pinned_op(gid, [h], [bp.blocks[block_id]], rid)
                if op is not None:
                    meta.stores.append(op)
                    if self.c._events_enabled:
                        self._remember_blocks(ours[gid], [self._state_item(req, boundary)])

    def _lazy_remember(self, group: int, h: bytes) -> None:
        self._lazy_seen[(group, h)] = None
        self._lazy_seen.move_to_end((group, h))
        while len(self._lazy_seen) > _MAX_LAZY_SEEN:
            self._lazy_seen.popitem(last=False)

    def _plan_lazy_stores(self, meta: UMBPConnectorMetadata) -> None:
        """lazy_offload: the stores picked after the last step's frees, and those of a scan
        now (blocks that reached the free queue's head otherwise)."""
        meta.stores.extend(self._lazy_ops)
        self._lazy_ops = []
        meta.stores.extend(self._lazy_pick())

    def _lazy_pick(self) -> list[BlockOp]:
        """lazy_offload: pins the cached blocks at the head of vLLM's free queue (the next
        to be evicted) that the pool does not hold yet, at most `lazy_offload_max_blocks`
        examined, and returns their stores. They stay pinned while the pool copies them,
        then go back to the free queue's tail (still cached in vLLM).

        Runs twice per step: from `build_connector_meta`, and from
        `update_connector_output`, which vLLM calls after it freed the step's finished
        requests and before the next `schedule()` allocates. Without the second scan a
        block freed in one step and evicted by the next step's allocation was never seen
        (vLLM frees a request's blocks last block first, so a prompt lost its tail: issue
        #33 item 9)."""
        bp = self.c._gpu_block_pool
        if bp is None:
            return []
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        ours = {g.gid: g for g in self.c._groups if g.kind != MAMBA}
        picked: dict[int, list[tuple[bytes, Any]]] = {}
        for n, blk in enumerate(bp.free_block_queue.iter_blocks_after(None)):
            if n >= self.c._offload.lazy_offload_max_blocks:
                break
            bh = blk.block_hash
            if bh is None or blk.is_null:
                continue
            gid = int(get_group_id(bh))
            if gid not in ours:
                continue
            h = bytes(get_block_hash(bh))
            if (gid, h) in self._lazy_seen:
                continue
            self._lazy_remember(gid, h)
            picked.setdefault(gid, []).append((h, blk))
        ops = []
        for gid, items in picked.items():
            op = self._pinned_op(gid, [h for h, _ in items], [b for _, b in items], "")
            if op is not None:
                ops.append(op)
                self.lazy_stored_blocks += len(items)
                if self.c._events_enabled:
                    self._remember_lazy_for_events(ours[gid], op.hashes)
        return ops

    def request_finished(
        self, request: "Request", block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        ctl = st.control if st is not None else request_control(request)
        if self.c._offload.lazy_offload and self.c._do_store and ctl.skip_save and not ctl.remote_decode:
            # umbp.skip_save under lazy offload: its blocks, about to reach the free queue,
            # are not offered to the pool (a block another request shares is skipped too).
            for g in self.c._groups:
                if g.kind != MAMBA:
                    for h in self._group_hashes(request, g):
                        self._lazy_remember(g.gid, h)
        if self.c._events_enabled and self.c._offload.lazy_offload and self.c._do_store:
            self._note_lazy_blocks(request)  # its blocks go to the free queue next
        params = self._handoff_params(request, st, ctl)
        if st is None:
            return False, params
        if st.async_load_pending:
            # An async load may still write the blocks; the worker's "finished receiving"
            # report (which vLLM handles for finished requests too) releases them.
            # No store is pending: the request stored nothing since its lookup, and its
            # stores before a preemption ended in handle_preemptions.
            return True, params
        if (
            st.load_block_ids
            and not self.c._recompute_failures
            and _finished_with_error(request)
        ):
            # A request failed by a load error: its synchronous load may have been started
            # by a pool that did not finish it in time (quarantined on the workers). Its
            # blocks stay until every worker reports the load over ("finished sending").
            self._finish_after_stores.append(request.request_id)
            return True, params
        if st.store_ops_done < st.store_ops * self.c._num_ranks:
            # Stores may still read the blocks: keep them until every worker reports the
            # request as "finished sending" (it learns which ones through the metadata).
            self._finish_after_stores.append(request.request_id)
            return True, params
        return False, params

    def _handoff_params(self, request: "Request", st: ReqState | None, ctl: RequestControl) -> dict[str, Any] | None:
        """Prefill side of a P/D handoff (`do_remote_decode`): what the decode engine needs,
        returned through vLLM to the client (the proxy passes it on): this engine's key
        namespace, the leading blocks stored for the request, and how long the decode
        engine may wait for them — this engine's `timeout_ms`, past which its stores are
        cancelled anyway."""
        if not ctl.remote_decode:
            return None
        if not self.c._do_store:
            logger.warning("UMBP: request %s asks for a remote decode, but this engine stores nothing (kv_role)", request.request_id)
            return None
        blocks = (st.stored_upto // self.c._block_size) if st is not None else 0
        self.c._stats.add("pd_handoffs_sent", 1)
        h = Handoff(self.namespace.hex(), blocks, self.cfg.timeout_ms)
        return {"do_remote_prefill": True, "do_remote_decode": False, "umbp.handoff": h.to_params()}

    def update_connector_output(self, out: "KVConnectorOutput") -> None:
        bad = out.invalid_block_ids
        if bad:
            for st in self._reqs.values():
                if st.load_block_ids and not bad.isdisjoint(st.load_block_ids):
                    st.load_failures += 1
                    st.failed_at_preemptions = int(getattr(st.request, "num_preemptions", 0))
                    st.load_block_ids = ()  # counted once; a new load sets them again
                    # vLLM recomputes from the first bad block; the recomputed blocks are
                    # not in the pool (that is why they failed), so they must be stored.
                    st.stored_upto = min(st.stored_upto, st.load_first)
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
            for op_id, ranks in wm.ops_done.items():
                self._unpin(op_id, ranks)
            for bk, ranks in wm.stored.items():
                pending = self._event_pending.get(bk)
                if pending is None:
                    continue
                ev, seen = pending
                seen += ranks
                # One store per key rank: with replicated KV stored once, only the rank
                # that stores a block of its group reports it.
                if seen >= self.c._key_ranks:
                    del self._event_pending[bk]
                    self._events.append(ev)
                    self._publish(bk, ev)
                else:
                    self._event_pending[bk] = (ev, seen)
        if self.c._do_store and self.c._offload.lazy_offload:
            # vLLM freed this step's finished requests before calling us, and the next
            # schedule() may evict their blocks: pick them now (see _lazy_pick).
            self._lazy_ops.extend(self._lazy_pick())

    # -- KV events ----------------------------------------------------------------------
    # Every group the connector stores is announced: a block is named by (group, hash) and
    # its BlockStored carries the group's index and vLLM's kind of the group
    # (`kv_cache_spec_kind`, and `kv_cache_spec_sliding_window` for sliding windows). Full
    # and sliding-window blocks are announced like vLLM's block pool announces them (hash,
    # parent hash, the block's tokens); a Mamba state, and a partial-hit tail, like vLLM
    # announces a partial entry: keyed by the hash of the prefix ending there, with the
    # tokens of its last hash block.

    def _remember_for_events(self, g: GroupInfo, req: Any, hashes: list[bytes], idxs: Any) -> None:
        """Prepare BlockStored events for blocks `idxs` of `req` in group `g`, published
        once all KV ranks (TP × PCP) stored the block."""
        bs = g.block_size
        tokens = req.all_token_ids
        self._remember_blocks(
            g, [(hashes[b], hashes[b - 1] if b else None, list(tokens[b * bs : (b + 1) * bs]), bs) for b in idxs]
        )

    def _state_item(self, req: Any, tokens: int) -> EventItem:
        """The event item of an object keyed by the hash of the prefix ending at `tokens`
        (a Mamba state, a partial-hit tail): as vLLM announces a partial entry."""
        hb = self.c._hash_block_size
        k = tokens // hb
        hashes = req.block_hashes
        parent = bytes(hashes[k - 2]) if k > 1 else None
        return (bytes(hashes[k - 1]), parent, list(req.all_token_ids[(k - 1) * hb : k * hb]), hb)

    def _note_lazy_blocks(self, req: Any) -> None:
        """lazy_offload with events: remember the parent hash and tokens of `req`'s full
        blocks of every group lazy offload stores (its blocks are being freed), so a later
        lazy store of one can be announced (a free-queue block carries only its hash).
        Bounded: the oldest are dropped, and a block stored without them is stored
        unannounced (counted as suppressed)."""
        try:
            tokens = req.all_token_ids
            for g in self.c._groups:
                if g.kind == MAMBA:
                    continue  # lazy offload does not store states
                hashes = self._group_hashes(req, g)
                bs = g.block_size
                n = min(len(hashes), len(tokens) // bs)
                for b in range(n):
                    bk = (g.gid, hashes[b])
                    if bk in self._lazy_block_info or bk in self._published:
                        continue
                    self._lazy_block_info[bk] = (hashes[b - 1] if b else None, list(tokens[b * bs : (b + 1) * bs]))
            while len(self._lazy_block_info) > _MAX_LAZY_INFO:
                self._lazy_block_info.popitem(last=False)
        except Exception as e:  # noqa: BLE001 - events are best effort
            logger.debug("UMBP: cannot note blocks for lazy-offload events: %s", e)

    def _remember_lazy_for_events(self, g: GroupInfo, hashes: list[bytes]) -> None:
        """BlockStored events for blocks of group `g` lazy offload picked."""
        items: list[EventItem] = []
        for h in hashes:
            info = self._lazy_block_info.pop((g.gid, h), None)
            if info is None:
                if (g.gid, h) not in self._published:
                    self.c._stats.add("events_suppressed", 1)
                continue
            items.append((h, info[0], info[1], g.block_size))
        self._remember_blocks(g, items)

    def _event_room(self, want: int) -> int:
        """kv_event_max_objects: how many of `want` new blocks may be tracked. When the
        tracked blocks (announced or about to be) fill it, new BlockStored events are
        suppressed until tracked blocks leave the pool; storing and lookups go on."""
        room = max(0, self.cfg.kv_event_max_objects - len(self._published) - len(self._event_pending))
        if want > room:
            if not getattr(self, "_events_full_logged", False):
                self._events_full_logged = True
                logger.warning(
                    "UMBP: kv_event_max_objects=%d blocks tracked: BlockStored events are "
                    "suppressed until tracked blocks leave the pool",
                    self.cfg.kv_event_max_objects,
                )
            self.c._stats.add("events_suppressed", want - room)
        return min(want, room)

    def _stored_event(self, g: GroupInfo, item: EventItem) -> Any:
        """vLLM's BlockStored for one block of group `g` (medium CPU: the pool's DRAM)."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        h, parent, toks, bsz = item
        kw: dict[str, Any] = dict(
            block_hashes=[maybe_convert_block_hash(h)],
            parent_block_hash=maybe_convert_block_hash(parent) if parent is not None else None,
            token_ids=toks,
            block_size=bsz,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=g.gid,
        )
        fields = getattr(BlockStored, "__struct_fields__", ())
        # Fields of the vLLM versions that describe the group in store events.
        if "kv_cache_spec_kind" in fields:
            kw["kv_cache_spec_kind"] = g.event_kind
        if "kv_cache_spec_sliding_window" in fields:
            kw["kv_cache_spec_sliding_window"] = g.sliding_window if g.kind == SLIDING else None
        return BlockStored(**kw)

    def _track(self, g: GroupInfo, hashes: list[bytes]) -> list[list[bytes]]:
        """Map the keys of `hashes` of group `g` (this namespace, every rank) back to their
        blocks, so that the pool's "removed" events can be named by block; returns the keys
        per block."""
        rank_keys = [make_keys(self.n, self.namespace, g.gid, r, hashes) for r in range(self.c._key_ranks)]
        out = []
        for i, h in enumerate(hashes):
            keys = [rk[i] for rk in rank_keys]
            self._block_keys[(g.gid, h)] = keys
            for k in keys:
                self._key_to_hash[k] = (g.gid, h)
            out.append(keys)
        return out

    def _remember_blocks(self, g: GroupInfo, items: list[EventItem]) -> None:
        """Prepare BlockStored events for blocks of group `g` given as (hash, parent hash,
        tokens, block size): published when every KV rank reported the store."""
        if not items:
            return
        if len(self._event_pending) > _MAX_EVENT_PENDING:
            for bk in list(self._event_pending):
                self._forget(bk)
        try:
            todo = [it for it in dict((it[0], it) for it in items).values() if (g.gid, it[0]) not in self._published]
            todo = todo[: self._event_room(len(todo))]
            self._track(g, [it[0] for it in todo])
            for it in todo:
                self._event_pending[(g.gid, it[0])] = (self._stored_event(g, it), 0)
        except Exception as e:  # noqa: BLE001 - events are best effort
            logger.debug("UMBP: cannot build KV events: %s", e)

    def _hit_blocks(self, request: Any, tokens: int) -> list[tuple[GroupInfo, list[bytes], Any]]:
        """Hybrid models: per group, (group, its hashes, indices) of the blocks a pool hit
        of `tokens` found (every group checked them present): a full-attention group's
        whole prefix, a sliding-window group's blocks inside the window, a Mamba group's
        state at the hit's end (an index into the prefix hashes of `request`)."""
        out: list[tuple[GroupInfo, list[bytes], Any]] = []
        hb = self.c._hash_block_size
        for g in self.c._groups:
            if g.kind == MAMBA:
                if tokens % hb == 0:
                    out.append((g, [], (tokens,)))
                continue
            hashes = self._group_hashes(request, g)
            idxs = range(tokens // g.block_size) if g.kind == FULL else g.needed_blocks(tokens)
            out.append((g, hashes, range(idxs.start, min(idxs.stop, len(hashes)))))
        return out

    def _announce_found(self, request: Any, found: list[tuple[GroupInfo, list[bytes], Any]]) -> None:
        """A lookup found blocks in the pool (stored by this engine or by another one that
        shares the pool): announce those this engine has not announced yet, at once (they
        are in the pool for every KV rank) and with the medium of the tier holding them,
        so a KV-aware router learns that this engine can serve them too. They are then
        tracked like our own: BlockRemoved when the pool drops them, re-announced when
        they change tier. `found`: (group, its hashes, block indices); a Mamba group's
        entries are token counts (its state after that many tokens)."""
        try:
            for g, hashes, idxs in found:
                items: list[EventItem] = []
                for i in idxs:
                    if g.kind == MAMBA:
                        it = self._state_item(request, i)
                    else:
                        bs = g.block_size
                        it = (hashes[i], hashes[i - 1] if i else None, list(request.all_token_ids[i * bs : (i + 1) * bs]), bs)
                    bk = (g.gid, it[0])
                    if bk not in self._published and bk not in self._event_pending:
                        items.append(it)
                if items:
                    self._announce_present(g, items)
        except Exception as e:  # noqa: BLE001 - events are best effort
            logger.debug("UMBP: cannot announce blocks found in the pool: %s", e)

    def _announce_present(self, g: GroupInfo, items: list[EventItem]) -> None:
        items = list(dict((it[0], it) for it in items).values())
        items = items[: self._event_room(len(items))]
        if not items:
            return
        all_keys = self._track(g, [it[0] for it in items])
        for it, keys in zip(items, all_keys):
            tiers = []
            for rank, key in enumerate(keys):
                idx = self._rank_index(rank)
                tier_of = getattr(idx, "tier", None) if idx is not None else None
                # A binding without Index.tier: the block was just found, read it as DRAM.
                t = tier_of(key) if tier_of is not None else "dram"
                if t is None:
                    break  # gone since the lookup (or the pool stalled): not announced
                tiers.append(t)
            if len(tiers) < len(keys):
                self._forget((g.gid, it[0]))
                continue
            for key, t in zip(keys, tiers):
                if t != "dram":
                    self._key_tier[key] = t
            tier = slowest_tier(tiers)
            ev = restamp(self._stored_event(g, it), tier)
            self._events.append(ev)
            bk = (g.gid, it[0])
            self._published[bk] = None
            self._announced[bk] = (ev, tier)

    def _publish(self, bk: BlockKey, ev: Any = None) -> None:
        self._published[bk] = None  # bounded by kv_event_max_objects (_event_room)
        if ev is not None:
            self._announced[bk] = (ev, "dram")

    def _forget(self, bk: BlockKey) -> None:
        self._event_pending.pop(bk, None)
        self._published.pop(bk, None)
        self._announced.pop(bk, None)
        for k in self._block_keys.pop(bk, ()):
            self._key_to_hash.pop(k, None)
            self._key_tier.pop(k, None)

    def _removed_event(self, bk: BlockKey, tier: str) -> Any:
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        return restamp(BlockRemoved(block_hashes=[maybe_convert_block_hash(bk[1])], medium="CPU", group_idx=bk[0]), tier)

    def _removed(self, bk: BlockKey, out: list[Any]) -> None:
        """The pool dropped (one rank's copy of) block `bk`: it can no longer be loaded."""
        if bk in self._published:
            out.append(self._removed_event(bk, self._announced.get(bk, (None, "dram"))[1]))
        self._forget(bk)

    def _retier(self, bk: BlockKey, out: list[Any]) -> None:
        """Block `bk`'s keys changed tier: announce it again under its new medium
        (BlockRemoved with the old one, then BlockStored with the new one)."""
        announced = self._announced.get(bk)
        if announced is None or bk not in self._published:
            return
        ev, old = announced
        new = slowest_tier(self._key_tier.get(k, "dram") for k in self._block_keys.get(bk, ()))
        if new == old:
            return
        out.append(self._removed_event(bk, old))
        ev = restamp(ev, new)
        out.append(ev)
        self._announced[bk] = (ev, new)

    def _apply_pool_events(self, idx: Any, events: list[Any], out: list[Any]) -> None:
        """The pool's events for keys we announced: a key whose last event is "stored" is
        in that tier now (a demotion or promotion moves it); one whose last event is
        "removed" left the pool, unless the index still lists it (a move whose "stored"
        comes with the next call)."""
        moved: list[BlockKey] = []
        for key, (kind, tier) in last_per_key(events, self._key_to_hash).items():
            bk = self._key_to_hash.get(key)
            if bk is None:
                continue  # forgotten with another rank's key of the same block
            if kind == "stored":
                self._key_tier[key] = tier
                moved.append(bk)
            elif kind == "removed":
                try:
                    still = bool(idx.contains(key))
                except Exception:  # noqa: BLE001 - a dead pool holds nothing
                    still = False
                if not still:
                    self._removed(bk, out)
        for bk in dict.fromkeys(moved):
            self._retier(bk, out)

    def _drain_pool_events(self, out: list[Any]) -> None:
        """Pool evictions and resets -> BlockRemoved for blocks we announced."""
        for i, idx in enumerate(self._indexes):
            if idx is None:
                continue
            take = getattr(idx, "take_tier_events", None) or getattr(idx, "take_events", None)
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
            self._apply_pool_events(idx, events, out)
            up = bool(getattr(idx, "connected", True))
            if self._index_was_up[i] and not up:
                # A dead pool took every object with it, and a restarted one starts empty.
                for bk in list(self._published):
                    self._removed(bk, out)
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
        for bk in list(self._event_pending):
            self._forget(bk)
        for st in self._reqs.values():
            st.pool_hit_tokens = 0
        logger.info("UMBP: reset_cache -> namespace %s; dropping pooled objects", self.namespace.hex())
        return True

    def shutdown(self) -> None:
        self._indexes = [None] * len(self._index_paths)


def _cached_as(block: Any, h: bytes) -> bool:
    """vLLM cached `block` (a KVCacheBlock) under hash `h`: its KV is complete."""
    bh = getattr(block, "block_hash", None)
    if bh is None:
        return False
    from vllm.v1.core.kv_cache_utils import get_block_hash

    return bytes(get_block_hash(bh)) == h
