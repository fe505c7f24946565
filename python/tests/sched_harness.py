"""A real vLLM `Scheduler` with UMBPStoreConnector, driven step by step without a model.

Built offline from a config.json-only model directory (`skip_tokenizer_init=True`), the
way vLLM's engine core builds it: resolve the KV layout, size the KV cache, build the
scheduler (which constructs the connector's scheduler role from the config). The worker
role is a second connector instance registered on real CPU KV tensors (vLLM's CPU
layout); each `step()` does what the model runner does around a forward pass, in the
observed order (docs/vllm-interface-notes.md), with a fake forward that writes a
recognisable value into every block it computes: value = f(block hash) + layer, so a
loaded block can be checked to hold exactly the bytes stored for its hash.

With `pcp=N` (prefill context parallelism) there is one worker-role connector per PCP
rank, each with its own KV tensors and (embedded mode) its own pool, every one told its
rank through vLLM's `get_pcp_group()` (faked here: one process has no process groups), all
driven with the same metadata, and their outputs combined by vLLM's own
`KVOutputAggregator` as the executor does. The fake forward writes the same bytes on every
PCP rank: vLLM 0.32 replicates the KV cache over PCP ranks without DCP.

With `tp=N` there is one worker-role connector per TP rank the same way (told its rank
through vLLM's `get_tensor_model_parallel_rank()`), each holding vLLM's share of the KV
heads: `max(1, heads // N)` per rank, rank `r` holding heads from `r * heads // N` on (with
fewer heads than ranks, consecutive ranks hold the same head, as vLLM replicates them). The
fake forward adds 10 × the rank's first head to every value, so a rank that loads another
head's bytes is caught. `mla=True` declares the group as MLA (one latent per token, the same
on every TP rank).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

BLOCK = 128  # vLLM's CPU block size
HEADS, HEAD_SIZE = 2, 32  # the tiny model's KV heads and head size
EOS = 0


def config_only_model_dir(model_dir: str) -> str:
    """A directory holding only the tiny model's config.json (no weights, no tokenizer)."""
    d = Path(tempfile.mkdtemp(prefix="umbp-cfg-"))
    (d / "config.json").write_text((Path(model_dir) / "config.json").read_text())
    return str(d)


def block_value(h: bytes) -> int:
    return 1 + h[0] % 100  # small ints are exact in bf16


class EventRecorder:
    """Stands in for vLLM's KV event publisher; keeps every published event."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass

    def take(self, medium: str = "CPU") -> list[Any]:
        """Events of `medium` (the connector's) since the last take."""
        mine = [e for e in self.events if getattr(e, "medium", None) == medium]
        self.events = []
        return mine


def connector_transfer_config(engine_id: str, extra: dict | None, kv_role: str, failure_policy: str) -> dict:
    """vLLM's `kv_transfer_config` for UMBPStoreConnector with `extra` connector options."""
    return {
        "kv_connector": "UMBPStoreConnector",
        "kv_connector_module_path": "umbp.vllm",
        "kv_role": kv_role,
        "kv_load_failure_policy": failure_policy,
        "engine_id": engine_id,
        "kv_connector_extra_config": dict(extra or {}),
    }


def finish_kv_cache_configs(vc: Any, kccs: list[Any]) -> tuple[Any, int, int]:
    """What EngineCore does after planning the workers' KV cache configs `kccs`: sets their
    layout, derives the scheduler's config and block sizes, and gives every config the hash
    block size and cache-hit alignment. Returns (scheduler config, block size, hash block size)."""
    from vllm.v1.core import kv_cache_utils as kcu

    for k in kccs:
        k.kv_cache_layout = vc.cache_config.kv_cache_layout
    skcc = kcu.generate_scheduler_kv_cache_config(kccs)
    vc.cache_config.num_gpu_blocks = skcc.num_blocks
    sbs, hbs = kcu.resolve_kv_cache_block_sizes(skcc, vc)
    align = kcu.resolve_cache_hit_alignment_tokens(skcc, vc, sbs, hbs)
    for k in (*kccs, skcc):
        k.hash_block_size, k.cache_hit_alignment_tokens = hbs, align
    return skcc, sbs, hbs


class Harness:
    def __init__(
        self,
        model_dir: str,
        extra: dict | None = None,
        kv_role: str = "kv_both",
        failure_policy: str = "recompute",
        events: bool = False,
        num_blocks: int = 64,
        engine_id: str | None = None,
        pcp: int = 1,
        tp: int = 1,
        mla: bool = False,
    ):
        from vllm.config import KVEventsConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core import kv_cache_utils as kcu
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

        from umbp.vllm import UMBPStoreConnector

        self.engine_id = engine_id or f"harness-{uuid.uuid4()}"
        ktc = connector_transfer_config(self.engine_id, extra, kv_role, failure_policy)
        kec = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if events else None
        args = EngineArgs(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
            enable_prefix_caching=True, enforce_eager=True, max_model_len=1024,
            block_size=BLOCK, seed=0, kv_transfer_config=ktc, kv_events_config=kec,
        )
        vc = self.vllm_config = args.create_engine_config()
        self.pcp = pcp
        if pcp > 1:
            # vLLM's CPU build refuses PCP > 1 in its config (only Model Runner V2 runs
            # PCP, and it needs Triton's GPU backend): set it where a GPU build has it. The
            # scheduler does not depend on it (vLLM 0.32 gives its KV cache manager
            # pcp_world_size=1).
            vc.parallel_config.prefill_context_parallel_size = pcp
        self.tp, self.mla = tp, mla
        if tp > 1:
            # vLLM's CPU build runs TP over processes; one test process plays every rank.
            vc.parallel_config.tensor_parallel_size = tp
        self.nranks = tp * pcp
        # vLLM's share of the KV heads per TP rank (replicated when there are fewer heads).
        heads = 1 if mla else max(1, HEADS // tp)
        self.heads_per_rank = heads
        if mla:
            # One latent of 2 x HEAD_SIZE per token: the same page size as one head's K and V.
            spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=2 * HEAD_SIZE, dtype=torch.bfloat16)
        else:
            spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
        specs = {n: spec for n in self.layers}
        # What EngineCore._initialize_kv_caches does, with a fixed memory budget.
        resolve_kv_cache_layout(vc, [["LBHNC"]], list(specs.values()))
        mem = [spec.page_size_bytes * len(specs) * num_blocks]
        if hasattr(kcu, "get_kv_cache_configs"):  # vLLM 0.32
            kccs = kcu.get_kv_cache_configs(vc, [specs], mem)
        else:  # vLLM 0.33: planning moved; specs registered, global groups first
            from vllm.v1.core import kv_cache_planning as kcp
            from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

            register_all_kvcache_specs(vc)
            kccs = kcp.get_kv_cache_configs(vc, [specs], mem, kcp.get_global_kv_cache_groups(vc, [specs]))
        skcc, sbs, hbs = finish_kv_cache_configs(vc, kccs)
        self.kv_cache_config = kccs[0]
        self.num_blocks = kccs[0].num_blocks

        # Workers first (each starts the embedded pool the scheduler's index attaches to),
        # as vLLM does; one per (PCP, TP) rank, in vLLM's order (pcp_rank * tp + tp_rank).
        (t,) = kccs[0].kv_cache_tensors
        per_layer = t.layer_stride // 2
        self.workers: list[Any] = []
        self.kv_buffers: list[torch.Tensor] = []
        self.kvs: list[dict[str, torch.Tensor]] = []
        for r in range(self.nranks):
            with fake_pcp_group(r // tp, pcp), fake_tp_rank(r % tp, tp):
                w = UMBPStoreConnector(vc, KVConnectorRole.WORKER, kccs[0])
            buf = torch.zeros(t.size // 2, dtype=torch.bfloat16)
            kv = {
                name: buf[i * per_layer : (i + 1) * per_layer].view(
                    self.num_blocks, heads, BLOCK, 2 * HEAD_SIZE
                )
                for i, name in enumerate(t.layers)
            }
            w.register_kv_caches(kv)
            self.workers.append(w)
            self.kv_buffers.append(buf)
            self.kvs.append(kv)
        # PCP rank 0's (the only one without PCP): what the single-worker tests use.
        self.worker, self.kv_buffer, self.kv = self.workers[0], self.kv_buffers[0], self.kvs[0]
        if self.nranks > 1:
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

            # What the executor builds: one finished report per worker (TP × PCP).
            self.aggregator = KVOutputAggregator.from_connector(self.worker, self.nranks)

        self._start_scheduler(skcc, sbs, hbs)
        self.sched.kv_event_publisher = self.recorder
        orig = self.conn.request_finished

        def spy(request: Any, block_ids: list[int]) -> tuple:
            r = orig(request, block_ids)
            self.finished_returns[request.request_id] = r
            return r

        self.conn.request_finished = spy  # type: ignore[method-assign]

    def _start_scheduler(self, skcc: Any, sbs: int, hbs: int) -> None:
        """The scheduler on `skcc` (it builds the connector's scheduler role, `self.conn`),
        the event recorder, the requests' block hasher and the per-run records."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils as kcu
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from umbp.vllm import UMBPStoreConnector

        vc = self.vllm_config
        self.sched = Scheduler(
            vllm_config=vc, kv_cache_config=skcc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=sbs, hash_block_size=hbs, log_stats=True,
        )
        self.conn = self.sched.connector
        assert isinstance(self.conn, UMBPStoreConnector)
        self.recorder = EventRecorder()
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        kcu.init_none_hash(hash_fn)
        self.block_hasher = kcu.get_request_block_hasher(hbs, hash_fn)
        self.stats: list[dict] = []  # SchedulerStats.kv_connector_stats payloads
        self.outputs: dict[str, list[Any]] = {}  # req id -> EngineCoreOutput list
        self.finished_returns: dict[str, tuple] = {}  # req id -> request_finished's return

    # -- requests ------------------------------------------------------------------------
    def request(self, rid: str, tokens: list[int], max_tokens: int = 1, kv_params: dict | None = None) -> Any:
        """A request as vLLM builds it; `kv_params` is its `kv_transfer_params` (the
        OpenAI API's field, passed in `SamplingParams.extra_args`)."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": dict(kv_params)} if kv_params is not None else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
        return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=sp,
                       pooling_params=None, block_hasher=self.block_hasher)

    def add(self, rid: str, tokens: list[int], max_tokens: int = 1, kv_params: dict | None = None) -> Any:
        req = self.request(rid, tokens, max_tokens, kv_params)
        self.sched.add_request(req)
        return req

    def block_ids(self, rid: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[0])

    # -- one engine step ----------------------------------------------------------------
    def step(self, before_worker: Callable[[Any], None] | None = None) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.sched.schedule()
        meta = so.kv_connector_metadata
        if before_worker is not None:
            before_worker(so)
        forward = bool(so.num_scheduled_tokens)
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        mros = []
        for rank, (w, kv) in enumerate(self._ranks()):
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            if forward:
                for name in self.layers:
                    w.wait_for_layer_load(name)
                if kv is None:
                    self._forward(so)
                else:
                    self._forward(so, kv, self.shard_offset(rank))
                for name in self.layers:
                    w.save_kv_layer(name, (self.kv if kv is None else kv)[name], None)
            w.wait_for_save()
            sending, recving = w.get_finished(so.finished_req_ids)
            kco = KVConnectorOutput(
                finished_sending=sending, finished_recving=recving,
                kv_connector_stats=w.get_kv_connector_stats(),
                invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=w.build_connector_worker_meta(),
            )
            w.clear_connector_metadata()
            mros.append(ModelRunnerOutput(req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=[list(x) for x in sampled], kv_connector_output=kco))
        mro = mros[0] if len(mros) == 1 else self.aggregator.aggregate(mros, output_rank=0)
        outs = self.sched.update_from_output(so, mro)
        if not forward:
            # The pool completes transfers on its own threads (~1 ms): an idle step that
            # only waits for them should not spin thousands of times meanwhile.
            time.sleep(0.001)
        for eco in outs.values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)
            st = eco.scheduler_stats
            if st is not None and st.kv_connector_stats:
                self.stats.append(dict(st.kv_connector_stats))
        return so

    def _ranks(self) -> list[tuple[Any, Any]]:
        """(worker connector, its KV for the fake forward, None: the harness's own) per KV
        rank; one without TP/PCP (harnesses built by subclasses set only `worker`)."""
        if getattr(self, "nranks", 1) > 1:
            return list(zip(self.workers, self.kvs))
        return [(self.worker, None)]

    def shard_offset(self, rank: int) -> int:
        """What the fake forward adds for KV rank `rank`: 10 x its first KV head (0 for MLA,
        whose latent every TP rank holds alike)."""
        tp = getattr(self, "tp", 1)
        if getattr(self, "mla", False) or tp == 1:
            return 0
        return 10 * ((rank % tp) * HEADS // tp)

    def _forward(self, so: Any, kv: dict[str, torch.Tensor] | None = None, offset: int = 0) -> None:
        kv = self.kv if kv is None else kv
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            after = req.num_computed_tokens  # already advanced by schedule()
            before = after - n
            ids = self.block_ids(rid)
            hashes = req.block_hashes
            for j in range(before // BLOCK, min(after // BLOCK, len(hashes))):
                for li, name in enumerate(self.layers):
                    kv[name][ids[j]].fill_(block_value(hashes[j]) + li + offset)

    def run(self, timeout: float = 20.0) -> int:
        """Steps until no request is left; returns how many steps that took."""
        deadline = time.monotonic() + timeout
        steps = 0
        while self.sched.has_requests():
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still unfinished after {steps} steps ({timeout} s)")
            self.step()
            steps += 1
        return steps

    def step_until(self, cond: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached in {timeout} s")
            self.step()

    # -- helpers --------------------------------------------------------------------------
    def reset_local_cache(self) -> None:
        """Empty vLLM's own prefix cache and the KV memory: only the pool can help now."""
        assert self.sched.reset_prefix_cache(), "blocks still held"
        for buf in getattr(self, "kv_buffers", None) or [self.kv_buffer]:
            buf.zero_()

    def store_and_forget(self, rid: str, tokens: list[int]) -> None:
        """Runs request `rid` on `tokens` to the end (its blocks are stored), then empties
        vLLM's own cache: a later request on the same prefix can only hit the pool."""
        self.add(rid, tokens)
        self.run()
        self.reset_local_cache()

    def holds_blocks_of(self, req: Any, ids: list[int], nblocks: int, rank: int = 0) -> bool:
        """KV rank `rank`'s KV holds the first `nblocks` blocks of `req` in `ids`."""
        kv = self.kvs[rank] if rank else self.kv
        for j in range(nblocks):
            for li, name in enumerate(self.layers):
                want = block_value(req.block_hashes[j]) + li + self.shard_offset(rank)
                if not bool((kv[name][ids[j]] == want).all()):
                    return False
        return True

    def external_tokens(self, rid: str) -> int:
        """Tokens of `rid`'s prompt that vLLM took from the connector (its prefill stats)."""
        for o in self.outputs.get(rid, ()):
            if o.prefill_stats is not None:
                return o.prefill_stats.num_external_cached_tokens
        raise AssertionError(f"no prefill stats for {rid}")

    def connector_stats(self) -> dict:
        """The connector's stats since the last call, reduced like vLLM's stats logger does."""
        from umbp.vllm import UMBPConnectorStats

        total = UMBPConnectorStats()
        for d in self.stats:
            total.aggregate(UMBPConnectorStats(data=dict(d)))
        self.stats = []
        return total.reduce()

    def pool_report(self) -> dict:
        pool = self.worker._worker.pool
        assert pool is not None, "not an embedded pool"
        return json.loads(pool.report())

    def close(self) -> None:
        self.sched.shutdown()
        for w in getattr(self, "workers", None) or [self.worker]:
            w.shutdown()


@contextmanager
def fake_pcp_group(rank: int, size: int):
    """vLLM's `get_pcp_group()` answering PCP rank `rank` of `size` (a worker process of a
    PCP engine knows its rank from its process group; one test process has none)."""
    from types import SimpleNamespace

    from vllm.distributed import parallel_state as ps

    if size <= 1:
        yield
        return
    orig = ps.get_pcp_group
    ps.get_pcp_group = lambda: SimpleNamespace(rank_in_group=rank, world_size=size)  # type: ignore[assignment]
    try:
        yield
    finally:
        ps.get_pcp_group = orig


@contextmanager
def fake_tp_rank(rank: int, size: int):
    """vLLM's `get_tensor_model_parallel_rank()` answering `rank` (one test process plays
    every TP rank of an engine)."""
    from vllm.distributed import parallel_state as ps

    if size <= 1:
        yield
        return
    orig = ps.get_tensor_model_parallel_rank
    ps.get_tensor_model_parallel_rank = lambda: rank  # type: ignore[assignment]
    try:
        yield
    finally:
        ps.get_tensor_model_parallel_rank = orig


def tokens(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
