"""The connector's worker half: pool attachment, KV registration, and submitting and
reaping the transfers the scheduler planned, in each worker process (one per TP rank, and
per PCP rank with prefill context parallelism: each keys its objects with its KV rank,
`keys.kv_rank`).

Transfers never block a step: stores are submitted after the forward and reaped later;
only synchronous loads are waited for (bounded by `timeout_ms`), because the forward
needs their bytes.

Cancel, never abandon: a transfer that outlives `timeout_ms` is cancelled through the
pool's cancel contract (docs/protocol.md), never just dropped. A cancelled store or a load
the pool had not started gives its blocks back at once (the pool will never touch them
again, even if it was only stopped and resumes later); only a load the pool has already
started keeps its blocks until the pool finishes it or dies.

A started synchronous load past `timeout_ms` does not hold the step (docs/connection.md,
"A started load that does not finish"): with vLLM's kv_load_failure_policy "fail" its
blocks are reported failed at once (the request fails) and quarantined: the scheduler
delays their free until the pool completes the load or dies. With "recompute" vLLM would
recompute into the very blocks the pool may still write, so the connector never plans a
synchronous load under "recompute" (connector.py forces loads asynchronous): a started
asynchronous load past `timeout_ms` keeps its request waiting (not reported received)
until the pool finishes it or dies, and the step never waits for it. A synchronous load
under "recompute" (only reachable by driving this class directly) is waited for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ._logging import get_logger
from .endpoints import embedded_socket_path
from .keep_attached import KeepAttached
from .keys import kv_rank, make_keys
from .layout import kv_layout
from .metadata import UMBPConnectorMetadata, UMBPWorkerMetadata

if TYPE_CHECKING:
    from .connector_view import ConnectorView

logger = get_logger("worker")


@dataclass
class Job:
    kind: str  # "load" | "store"
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]
    t0: int  # perf_counter_ns at submit
    sync: bool = False  # a load the current step's forward waits for
    group: int = 0  # KV cache group
    op_id: int | None = None  # pinned store op (reported in ops_done)


def tp_rank_of_this_worker() -> int:
    """This worker's TP rank (0 where vLLM's TP group is not initialised: one rank)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - TP group not initialised: single rank
        return 0


def pcp_rank_of_this_worker(pcp_size: int) -> int:
    """This worker's prefill-context-parallel rank, from vLLM's PCP group (as vLLM's own
    Mooncake store connector reads it); 0 without PCP."""
    if pcp_size <= 1:
        return 0
    from vllm.distributed.parallel_state import get_pcp_group

    # With PCP > 1 the group must exist (vLLM initialises it before building the
    # connector's worker half); a missing one is an error, never every rank as rank 0,
    # which would make the PCP ranks overwrite each other's objects.
    rank = int(get_pcp_group().rank_in_group)
    if not 0 <= rank < pcp_size:
        raise RuntimeError(f"UMBP: PCP rank {rank} outside prefill_context_parallel_size {pcp_size}")
    return rank


class WorkerSide:
    def __init__(self, c: "ConnectorView"):
        self.c = c
        self.cfg = c._cfg
        self.n = c._native
        self.tp_rank = tp_rank_of_this_worker()
        pcp_size = int(getattr(c, "_pcp_size", 1) or 1)
        self.pcp_rank = pcp_rank_of_this_worker(pcp_size)
        # The rank this worker's keys carry: TP rank and PCP rank in one number.
        self.rank = kv_rank(self.tp_rank, self.pcp_rank, c._tp_size)
        # The rank its keys carry: the KV rank, or its replica group's where the TP ranks
        # hold the same KV and it is stored once (replicas.py).
        self.replicas = c._replicas
        self.key_rank = self.replicas.key_rank(self.tp_rank, self.pcp_rank)
        num_ranks = int(getattr(c, "_num_ranks", c._tp_size))
        # Socket and SSD directory names carry the PCP rank only with PCP > 1.
        pcp_name = self.pcp_rank if pcp_size > 1 else None
        self.pool = None
        if self.cfg.embedded:
            path = embedded_socket_path(
                self.n.default_socket_path(), c._engine_id, c._dp_rank, self.tp_rank,
                lookup_dir=self.cfg.lookup_dir, instance=self.cfg.instance, pcp_rank=pcp_name,
            )
            cap = self.cfg.capacity_per_worker(num_ranks)
            # The pool's default (64 KiB) unless this engine's objects are smaller.
            est = getattr(c, "_object_bytes_estimate", None)
            min_object = min(64 << 10, est) if est else None
            try:
                self.pool = self.n.EmbeddedPool(
                    cap,
                    socket_path=path,
                    min_object_bytes=min_object,
                    # watermarks, hugepages, NUMA, ..., this rank's SSD directories
                    **self.cfg.embedded_pool_kwargs(c._dp_rank, self.tp_rank, num_ranks, pcp_rank=pcp_name),
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
                # The pool records (and reports) the KV rank among the engine's workers.
                tp_rank=self.rank,
                tp_size=num_ranks,
                dp_rank=c._dp_rank,
                timeout_ms=self.cfg.timeout_ms,
                startup_timeout_ms=self.cfg.startup_timeout_ms,
                pool_uid=self.cfg.pool_uid,
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
        # A standalone pool may restart while this engine is idle: re-attach in the
        # background (keep_attached.py), not at the next request. An embedded pool lives and
        # dies with this process.
        self._keeper = KeepAttached(self.w) if self.pool is None else None
        self.object_bytes = 0  # the first full-attention group's
        self.group_object_bytes: dict[int, int] = {}
        self._registered = False
        self._async_loads: dict[str, int] = {}  # async load ops in flight per request
        self.totals = {"stored_blocks": 0, "stored_bytes": 0, "loaded_blocks": 0}
        self._jobs: dict[int, Job] = {}
        self._sync_loads: list[int] = []  # transfer ids the current forward waits for
        self._req_stores: dict[str, set[int]] = {}  # in-flight store transfers per request
        self._finishing: set[str] = set()  # finished requests whose free waits for our stores
        self._store_done: dict[str, int] = {}  # store ops with a known outcome, per request
        self._finished_recving: set[str] = set()
        self._load_errors: set[int] = set()
        # Started synchronous loads past timeout_ms, reported failed: their blocks stay out
        # of reuse (the request's free is delayed) until the pool completes them or dies.
        self._quarantined: dict[int, Job] = {}
        self._stored_hashes: dict[tuple[int, bytes], int] = {}  # (group, hash) -> stores
        self._ops_done: dict[int, int] = {}
        self._on_cuda = False

    # -- registration -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the paged KV memory once, and each group's layout (layout.py).

        CPU storages are registered as host memory (the pool reads and writes them with
        process_vm_readv/writev); GPU storages through CUDA IPC.
        """
        kcc = self.c._kv_cache_config
        # One layout per KV cache group (hybrid models have several); groups of a hybrid
        # model share the same memory, so each storage is registered once.
        layouts = {
            g.gid: kv_layout(kv_caches, kcc.kv_cache_groups[g.gid].layer_names, int(kcc.num_blocks))
            for g in self.c._groups
        }
        alloc_of: dict[tuple[str, int, int], int] = {}
        storages = []
        nsegs = 0
        for gid, lay in layouts.items():
            ids = []
            for st in lay.storages:
                k = (st.device, st.device_index, st.base)
                if k not in alloc_of:
                    storages.append(st)
                    if st.device == "cpu":
                        alloc_of[k] = int(self.w.register_host_memory(st.base, st.nbytes))
                    else:
                        alloc_of[k] = int(self.w.register_cuda_memory(st.base, st.nbytes, st.device_index))
                ids.append(alloc_of[k])
            segments = [seg.as_tuple(ids) for seg in lay.segments]
            nsegs += len(segments)
            self.group_object_bytes[gid] = int(self.w.register_layout(gid, segments))
        self.object_bytes = self.group_object_bytes[self.c._group]
        # GPU kernels run asynchronously: a store submitted after the forward must be
        # ordered after it on the GPU (stream fence), not just after it on the CPU.
        self._on_cuda = any(st.device != "cpu" for st in storages)
        self._registered = True
        logger.info(
            "UMBP: registered %d segment(s), %d allocation(s), bytes per block object by "
            "group %s (tp_rank %d, pcp_rank %d)",
            nsegs,
            len(alloc_of),
            self.group_object_bytes,
            self.tp_rank,
            self.pcp_rank,
        )

    # -- per-step -----------------------------------------------------------------------
    def on_metadata(self, meta: UMBPConnectorMetadata) -> None:
        # Recorded at bind time, so the "finished sending" report always matches the
        # scheduler's delayed free, whatever happens later in the step.
        self._finishing.update(meta.finish_after_stores)
        if meta.reset_pool:
            self._reset_pool()

    def _reset_pool(self) -> None:
        """Drop this engine's objects from the pool (vLLM reset_cache).

        Stores still in flight would publish after the drop; they are awaited first (each
        at most timeout_ms). Whatever escapes (a pinned object, a pool that is down) is
        unreachable anyway: the scheduler switched to a new key namespace.
        """
        for tid, job in list(self._jobs.items()):
            if job.kind == "store":
                self._wait(tid)
        try:
            n = int(self.w.reset_namespace())
            logger.info("UMBP: reset_cache dropped %d object(s) from the pool (tp_rank %d, pcp_rank %d)", n, self.tp_rank, self.pcp_rank)
        except Exception as e:  # noqa: BLE001 - the namespace switch still hides them
            logger.warning("UMBP: reset_cache could not drop pooled objects: %s", e)

    def _keys(self, meta: UMBPConnectorMetadata, group: int, hashes: list[bytes]) -> list[bytes]:
        return make_keys(self.n, meta.namespace, group, self.key_rank, hashes)

    def handle_preemptions(self, meta: UMBPConnectorMetadata) -> None:
        """Preempted requests' blocks are reused right after: their stores finish first,
        or are cancelled (after timeout_ms, at once while the pool is stalled) so that
        the pool never reads the next owner's KV into them."""
        for rid in meta.preempted:
            for tid in list(self._req_stores.get(rid, ())):
                self._wait(tid)

    def start_load_kv(self, meta: UMBPConnectorMetadata) -> None:
        for op in meta.loads:
            if not op.block_ids:
                if op.is_async and not self._async_loads.get(op.req_id):
                    self._finished_recving.add(op.req_id)  # nothing to wait for
                continue
            group = meta.group if op.group is None else op.group
            job = Job(
                "load",
                op.req_id,
                op.hashes,
                op.block_ids,
                time.perf_counter_ns(),
                sync=not op.is_async,
                group=group,
            )
            if op.is_async:
                # Reported "received" once every op of the request (one per group) is done.
                self._async_loads[op.req_id] = self._async_loads.get(op.req_id, 0) + 1
            self.c._stats.add("load_ops", 1)
            self.c._stats.add("load_blocks", len(op.block_ids))
            try:
                if not self._registered:
                    raise RuntimeError("KV caches not registered")
                tid = int(self.w.load(group, self._keys(meta, group, op.hashes), op.block_ids))
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
            job = self._jobs.get(tid)
            if job is None:
                continue
            statuses = self._wait(tid)
            self._jobs.pop(tid, None)
            self._finish_load(job, statuses)

    def wait_for_save(self, meta: UMBPConnectorMetadata) -> None:
        # Synchronous loads not waited for by an attention layer still finish this step, so
        # their errors are reported in the step that used them.
        self.wait_for_sync_loads()
        for op in meta.stores:
            if not op.block_ids:
                continue
            group = meta.group if op.group is None else op.group
            keys = self._keys(meta, group, op.hashes)
            hashes, block_ids = op.hashes, op.block_ids
            if self.replicas.replicas > 1:
                # Replicated KV: this rank stores only the blocks its group gives it; the
                # group's other ranks store the rest (one copy each), every rank loads all.
                mine = [i for i, k in enumerate(keys) if self.replicas.stores(self.tp_rank, k)]
                self.c._stats.add("store_replica_skipped_blocks", len(keys) - len(mine))
                keys = [keys[i] for i in mine]
                hashes = [hashes[i] for i in mine]
                block_ids = [block_ids[i] for i in mine]
            job = Job(
                "store", op.req_id, hashes, block_ids, time.perf_counter_ns(), group=group, op_id=op.op_id
            )
            self.c._stats.add("store_ops", 1)
            self.c._stats.add("store_blocks", len(block_ids))
            if not block_ids:
                self._op_done(job)  # every worker reports every op: the scheduler counts them
                continue
            try:
                if not self._registered:
                    raise RuntimeError("KV caches not registered")
                stream = torch.cuda.current_stream().cuda_stream if self._on_cuda else None
                tid = int(self.w.store(group, keys, block_ids, stream=stream))
            except Exception as e:  # noqa: BLE001 - pool gone / refusing: not stored
                logger.debug("UMBP: store for %s not submitted: %s", op.req_id, e)
                self.c._stats.add("store_not_stored_blocks", len(block_ids))
                self._op_done(job)
                continue
            self._jobs[tid] = job
            if job.op_id is None:
                self._req_stores.setdefault(op.req_id, set()).add(tid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Which requests to report as sent comes from the scheduler
        # (metadata.finish_after_stores); other finished requests have nothing in flight.
        self._reap()
        self._cancel_overdue()
        for rid in finished_req_ids:
            if rid not in self._finishing and not self._req_stores.get(rid):
                self._req_stores.pop(rid, None)
        held = {j.req_id for j in self._quarantined.values()}
        sending = {rid for rid in self._finishing if not self._req_stores.get(rid) and rid not in held}
        for rid in sending:
            self._finishing.discard(rid)
            self._req_stores.pop(rid, None)
        recving, self._finished_recving = self._finished_recving, set()
        return (sending or None), (recving or None)

    def take_load_errors(self) -> set[int]:
        errs, self._load_errors = self._load_errors, set()
        return errs

    def take_worker_meta(self) -> UMBPWorkerMetadata | None:
        if not self._stored_hashes and not self._store_done and not self._ops_done:
            return None
        meta = UMBPWorkerMetadata(
            store_done=self._store_done, stored=self._stored_hashes, ops_done=self._ops_done
        )
        self._stored_hashes, self._store_done, self._ops_done = {}, {}, {}
        return meta

    def _op_done(self, job: "Job") -> None:
        """A store's outcome is known: tell the scheduler (request-held or pinned op)."""
        if job.op_id is not None:
            self._ops_done[job.op_id] = self._ops_done.get(job.op_id, 0) + 1
        else:
            self._store_done[job.req_id] = self._store_done.get(job.req_id, 0) + 1

    # -- completions --------------------------------------------------------------------
    def _wait(self, tid: int) -> list[int]:
        """Wait for one transfer (at most timeout_ms, not at all while the pool is
        stalled), then cancel it; return its statuses and dispatch a store's.

        Never returns while the pool may still write the transfer's blocks: a load the
        pool has started is waited for until it completes or the pool dies (its blocks
        belong to a request of this step, which cannot run without them).
        """
        try:
            res = None if self.w.stalled else self.w.wait(tid, self.cfg.timeout_ms)
            if res is None:
                res = self._cancel(tid)
        except Exception as e:  # noqa: BLE001 - treat as failed
            logger.warning("UMBP: wait(%d) failed: %s", tid, e)
            res = []
        job = self._jobs.get(tid)
        if job is not None and job.kind == "store":
            self._jobs.pop(tid, None)
            self._finish_store(tid, job, list(res))
        return list(res)

    def _cancel(self, tid: int) -> list[int]:
        """Cancel a transfer past its time; returns its statuses (all failed when
        cancelled). A synchronous load the pool has started is quarantined (reported
        failed now, its blocks kept out of reuse until the pool completes it or dies);
        under kv_load_failure_policy "recompute", where the connector plans no synchronous
        load, one would be waited for instead, without bound."""
        outcome = self.w.cancel(tid)
        self.c._stats.add("cancelled_transfers" if outcome == "cancelled" else "cancel_refused", 1)
        job = self._jobs.get(tid)
        if outcome == "started" and job is not None and job.kind == "load" and not self.c._recompute_failures:
            self._quarantined[tid] = job
            self.c._stats.add("quarantined_loads", 1)
            logger.warning(
                "UMBP: load %d for %s was started by a pool that did not finish it in %d ms; "
                "its %d blocks are reported failed and kept out of reuse until the pool "
                "finishes it or dies",
                tid,
                job.req_id,
                self.cfg.timeout_ms,
                len(job.block_ids),
            )
            return []
        waited = 0
        while True:
            res = self.w.wait(tid, 0 if outcome != "started" else self.cfg.timeout_ms)
            if res is not None:
                return list(res)
            if outcome != "started":
                return []  # already returned elsewhere: nothing of it is usable here
            waited += self.cfg.timeout_ms
            logger.warning(
                "UMBP: load %d was started by a stalled pool; its blocks stay in use until "
                "the pool finishes it or dies (%d ms so far)",
                tid,
                waited,
            )

    def _cancel_overdue(self) -> None:
        """Cancel stores and asynchronous loads past timeout_ms, so that a stalled pool
        never holds the engine's blocks (a finished request's blocks wait for its stores;
        an async load's wait for the load). A started load keeps its blocks."""
        deadline = time.perf_counter_ns() - self.cfg.timeout_ms * 1_000_000
        for tid, job in list(self._jobs.items()):
            if job.t0 > deadline or job.sync:
                continue
            outcome = self.w.cancel(tid)
            if outcome == "started":
                continue
            self.c._stats.add("cancelled_transfers", 1)
            res = self.w.wait(tid, 0)
            self._jobs.pop(tid, None)
            statuses = list(res) if res is not None else []
            logger.warning(
                "UMBP: %s %d for %s got no answer in %d ms; cancelled, its blocks are free",
                job.kind,
                tid,
                job.req_id,
                self.cfg.timeout_ms,
            )
            if job.kind == "store":
                self._finish_store(tid, job, statuses)
            else:
                self._finish_load(job, statuses)

    def _reap(self) -> None:
        try:
            done = self.w.poll()
        except Exception as e:  # noqa: BLE001
            logger.debug("UMBP: poll failed: %s", e)
            done = []
        for tid, statuses in done:
            held = self._quarantined.pop(int(tid), None)
            if held is not None:
                # The pool finished (or died with) a quarantined load: its request's
                # delayed free may go ahead (get_finished).
                logger.info("UMBP: quarantined load %d for %s is over; its blocks are free", int(tid), held.req_id)
                continue
            job = self._jobs.pop(int(tid), None)
            if job is None:
                continue  # abandoned (timed-out synchronous load) or already handled
            if job.kind == "store":
                self._finish_store(int(tid), job, list(statuses))
            else:
                if job.sync and int(tid) in self._sync_loads:
                    self._sync_loads.remove(int(tid))
                self._finish_load(job, list(statuses))

    def _finish_load(self, job: Job, statuses: list[int] | None) -> None:
        ok = self.n.STATUS_LOADED
        st = statuses if statuses is not None else []
        failed = [b for i, b in enumerate(job.block_ids) if i >= len(st) or st[i] != ok]
        # vLLM truncates the request at its first invalid block, so reporting exactly the
        # failed ones is enough.
        self._load_errors.update(failed)
        stats = self.c._stats
        stats.add("load_failed_blocks", len(failed))
        good = len(job.block_ids) - len(failed)
        stats.add("load_bytes", good * self.group_object_bytes.get(job.group, self.object_bytes))
        stats.add("load_ns", time.perf_counter_ns() - job.t0)
        self.totals["loaded_blocks"] += good
        if not job.sync:
            left = self._async_loads.get(job.req_id, 1) - 1
            if left > 0:
                self._async_loads[job.req_id] = left
            else:
                self._async_loads.pop(job.req_id, None)
                self._finished_recving.add(job.req_id)

    def _finish_store(self, tid: int, job: Job, statuses: list[int]) -> None:
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
                bk = (job.group, h)  # KV events name blocks by (group, hash)
                self._stored_hashes[bk] = self._stored_hashes.get(bk, 0) + 1
        stats = self.c._stats
        stats.add("store_stored_blocks", stored)
        stats.add("store_present_blocks", present)
        stats.add("store_not_stored_blocks", len(job.hashes) - stored - present)
        nbytes = stored * self.group_object_bytes.get(job.group, self.object_bytes)
        stats.add("store_bytes", nbytes)
        stats.add("store_ns", time.perf_counter_ns() - job.t0)
        self.totals["stored_blocks"] += stored
        self.totals["stored_bytes"] += nbytes
        self._op_done(job)
        pending = self._req_stores.get(job.req_id)
        if pending is not None:
            pending.discard(tid)

    def shutdown(self) -> None:
        # Give in-flight stores a bounded chance to land; vLLM releases the blocks next.
        deadline = time.monotonic() + self.cfg.timeout_ms / 1000
        while any(j.kind == "store" for j in self._jobs.values()) and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.005)
        for tid, job in list(self._jobs.items()):
            if job.kind == "store":
                self.w.cancel(tid)  # never published after the blocks go back
        keeper = getattr(self, "_keeper", None)
        if keeper is not None:
            keeper.stop()
        # The whole shutdown stays within timeout_ms: a stopped pool's started loads are
        # waited for only with what is left of it (the worker's own drop would wait another
        # timeout_ms).
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        w = getattr(self, "w", None)
        pool = getattr(self, "pool", None)
        for obj, close in ((w, lambda: w.close(timeout_ms=left_ms)), (pool, lambda: pool.close())):
            if obj is None:
                continue
            try:
                close()
            except Exception as e:  # noqa: BLE001
                logger.debug("UMBP: close failed: %s", e)
        self.pool = None
