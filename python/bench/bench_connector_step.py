"""Connector overhead per engine step when nothing hits, against no connector, in one run.

    python python/bench/bench_connector_step.py [--json] [--rounds 15] [--batch 8]
        [--prompt-len 300] [--max-tokens 32]

Each configuration is a real vLLM CPU engine (one process each, the tiny Qwen2 of
python/tests/tiny_model.py), all started first and then driven in turns on identical work:
round r is the same batch of `batch` distinct prompts (greedy, `max-tokens` each) given to
every engine in turn, after one warm-up batch. Taking turns spreads whatever else the
machine is doing over all configurations alike. Every prompt is new, so neither vLLM's prefix
cache nor the pool can hit: what is measured is what the connector costs a step when it
cannot help (lookups that miss, stores of every full prompt block into an embedded pool,
metadata, completion reaping). The time of each EngineCore step that ran the model is
recorded (`EngineCore.step_fn`). Reported, both ways: ms/step as the median over rounds of
each round's mean (a round that a burst of other work on the machine slowed is an outlier,
not a shift), the median of the per-round paired ratios, the overall mean, and
(`connector_hooks_ms_per_step`) the time spent inside the connector's hooks themselves,
which the machine's noise does not blur. The pool's own threads (the store copies) run
beside the engine and show only in the step times.

Cases: `umbp kv_both` (the default) and `umbp kv_consumer` (lookups only, no stores),
each against `no connector`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from _report import case, emit  # noqa: E402

MARK = "@@BENCH@@ "


HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "request_finished", "update_connector_output", "take_events", "get_kv_connector_stats",
    "handle_preemptions", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load",
    "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
    "build_connector_worker_meta", "clear_connector_metadata",
)


def _timed_hook(fn, acc, per, name):
    def wrapper(*a, **kw):
        t = time.perf_counter_ns()
        try:
            return fn(*a, **kw)
        finally:
            dt = time.perf_counter_ns() - t
            acc[0] += dt
            per[name] = per.get(name, 0) + dt

    return wrapper


def child(args: argparse.Namespace) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(REPO / "python" / "tests"))
    import random

    from tiny_model import build_tiny_model
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict = dict(model=build_tiny_model(), dtype="bfloat16", enable_prefix_caching=True,
                    enforce_eager=True, max_model_len=1024, seed=0)
    if args.child != "none":
        kw["kv_transfer_config"] = {
            "kv_connector": "UMBPStoreConnector", "kv_connector_module_path": "umbp.vllm",
            "kv_role": args.child, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"mode": "embedded", "capacity_bytes": "1GiB"},
        }
    llm = LLM(**kw)
    ec = llm.llm_engine.engine_core.engine_core
    times: list[int] = []
    inner = ec.step_fn

    def timed():
        t = time.perf_counter_ns()
        out = inner()
        dt = time.perf_counter_ns() - t
        if out[1]:  # the model ran in this step
            times.append(dt)
        return out

    ec.step_fn = timed
    hook_ns = [0]
    per_hook: dict[str, int] = {}
    if args.child != "none":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        # Time spent inside the connector's own hooks (both roles): its direct cost,
        # without the noise of the rest of the step.
        for conn in (ec.scheduler.connector, get_kv_transfer_group()):
            for name in HOOKS:
                fn = getattr(conn, name, None)
                if fn is not None:
                    setattr(conn, name, _timed_hook(fn, hook_ns, per_hook, name))
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        rnd = int(line)
        rng = random.Random(1000 + rnd)
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(2, 1000) for _ in range(args.prompt_len)])
                   for _ in range(args.batch)]
        times.clear()
        hook_ns[0] = 0
        per_hook.clear()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        cached = sum(o.num_cached_tokens or 0 for o in outs)
        print(MARK + json.dumps({"times_ns": times, "cached_tokens": cached, "hook_ns": hook_ns[0],
                                 "per_hook_ns": per_hook}),
              flush=True)
    return 0


class Child:
    def __init__(self, kind: str, args: argparse.Namespace):
        self.kind = kind
        cmd = [sys.executable, __file__, "--child", kind, "--batch", str(args.batch),
               "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, cwd=str(REPO))

    def answer(self) -> dict:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise SystemExit(f"{self.kind}: engine exited ({self.p.wait()})")

    def round(self, r: int) -> dict:
        assert self.p.stdin is not None
        self.p.stdin.write(f"{r}\n")
        self.p.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        self.p.wait(timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--roles", default="kv_both,kv_consumer")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    kinds = ["none", *args.roles.split(",")]
    children = [Child(k, args) for k in kinds]  # engines start in parallel
    try:
        for c in children:
            c.answer()  # ready
        times: dict[str, list[int]] = {k: [] for k in kinds}
        rounds: dict[str, list[float]] = {k: [] for k in kinds}  # mean ms/step per round
        cached: dict[str, int] = {k: 0 for k in kinds}
        hooks: dict[str, int] = {k: 0 for k in kinds}
        per_hook: dict[str, dict[str, int]] = {k: {} for k in kinds}
        for r in range(args.rounds + 1):
            if not args.json:
                print(f"round {r}/{args.rounds}", file=sys.stderr, flush=True)
            for c in children:
                res = c.round(r)
                if r == 0:
                    continue  # warm-up
                times[c.kind] += res["times_ns"]
                rounds[c.kind].append(sum(res["times_ns"]) / len(res["times_ns"]) / 1e6)
                cached[c.kind] += res["cached_tokens"]
                hooks[c.kind] += res["hook_ns"]
                for name, ns in res["per_hook_ns"].items():
                    per_hook[c.kind][name] = per_hook[c.kind].get(name, 0) + ns
    finally:
        for c in children:
            c.close()
    bt = times["none"]
    b_ms = statistics.median(rounds["none"])
    cases = []
    for role in kinds[1:]:
        t = times[role]
        ms = statistics.median(rounds[role])
        paired = [u / n for u, n in zip(rounds[role], rounds["none"])]
        cases.append(case(
            "py_connector_step", f"umbp_{role}_zero_hits", ms, "ms/step", b_ms, "no connector",
            ratio=round(ms / b_ms, 3), paired_ratio_median=round(statistics.median(paired), 3),
            overhead_ms=round(ms - b_ms, 3),
            connector_hooks_ms_per_step=round(hooks[role] / len(t) / 1e6, 4),
            top_hooks_us_per_step={n: round(v / len(t) / 1e3, 1) for n, v in
                                   sorted(per_hook[role].items(), key=lambda kv: -kv[1])[:4]},
            mean_ms=round(sum(t) / len(t) / 1e6, 3), baseline_mean_ms=round(sum(bt) / len(bt) / 1e6, 3),
            p50_ms=round(statistics.median(t) / 1e6, 3), baseline_p50_ms=round(statistics.median(bt) / 1e6, 3),
            steps=len(t), baseline_steps=len(bt), cached_tokens=cached[role],
            baseline_cached_tokens=cached["none"], batch=args.batch, prompt_len=args.prompt_len,
            max_tokens=args.max_tokens, rounds=args.rounds,
        ))
    emit(cases, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
