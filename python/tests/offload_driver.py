"""Run one real vLLM CPU engine (one process) through a fixed list of commands, for the
hybrid-model and lazy-offload tests; prints one `@@UMBP@@ {json}` record per command.

    python python/tests/offload_driver.py --model DIR [--extra JSON] [--no-connector]
        [--num-gpu-blocks N] [--prompt-len N] --commands run:7,run:8,reset,run:7,totals

    run:SEED   generate the prompt of SEED greedily -> tokens, num_cached_tokens
    reset      llm.reset_prefix_cache() (retried while the connector still holds blocks)
    metrics    vLLM's prefix-cache counters (local and external)
    totals     the connector's cumulative counters: blocks and bytes the worker stored,
               blocks it loaded, blocks lazy offload picked, the KV cache groups
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from engine_driver import emit, emit_error, prefix_cache_metrics, prompt_token_ids, serve


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--extra", default=None)
    ap.add_argument("--no-connector", action="store_true")
    ap.add_argument("--num-gpu-blocks", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=700)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--commands", required=True)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kw: dict = dict(model=args.model, dtype="bfloat16", enable_prefix_caching=True,
                        enforce_eager=True, max_model_len=1024, seed=0, disable_log_stats=False)
        if args.num_gpu_blocks:
            kw["num_gpu_blocks_override"] = args.num_gpu_blocks
        if not args.no_connector:
            extra = {"mode": "embedded", "capacity_bytes": "256MiB"}
            extra.update(json.loads(args.extra or "{}"))
            kw["kv_transfer_config"] = {
                "kv_connector": "UMBPStoreConnector", "kv_connector_module_path": "umbp.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            }
        llm = LLM(**kw)
    except Exception as e:  # noqa: BLE001
        emit_error("startup", e)
        return 1
    emit({"event": "ready"})
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    dummy = TokensPrompt(prompt_token_ids=[5])

    def connectors():
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
        return sched, get_kv_transfer_group()

    def run(arg: str) -> dict:
        p = TokensPrompt(prompt_token_ids=prompt_token_ids(int(arg), args.prompt_len))
        (o,) = llm.generate([p], sp, use_tqdm=False)
        return {"cmd": "run", "seed": int(arg), "tokens": list(o.outputs[0].token_ids),
                "num_cached_tokens": o.num_cached_tokens}

    def reset(_: str) -> dict:
        ok = False
        for tries in range(20):
            if llm.reset_prefix_cache():
                ok = True
                break
            llm.generate([dummy], SamplingParams(max_tokens=1), use_tqdm=False)
            time.sleep(0.05 * (tries + 1))
        return {"cmd": "reset", "ok": ok}

    def totals(_: str) -> dict:
        sched, worker = connectors()
        # Let in-flight stores land first (a step reaps them).
        for _ in range(5):
            llm.generate([dummy], SamplingParams(max_tokens=1), use_tqdm=False)
            time.sleep(0.1)
        return {"cmd": "totals", **worker._worker.totals,
                "lazy_stored_blocks": sched._sched.lazy_stored_blocks,
                "pinned_ops": len(sched._sched._pins),
                "groups": [[g.gid, g.kind, g.block_size] for g in sched._groups]}

    commands = (cmd.partition(":")[::2] for cmd in args.commands.split(","))
    return serve(commands, {
        "run": run,
        "reset": reset,
        "metrics": lambda _: {"cmd": "metrics", "metrics": prefix_cache_metrics(llm)},
        "totals": totals,
    })

if __name__ == "__main__":
    sys.exit(main())
