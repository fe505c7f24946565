"""Drive one real vLLM CPU engine with the UMBP connector, for the e2e tests.

Run as a separate process (one engine per process, so several engines can share a pool):

    python python/tests/engine_driver.py --model DIR [--mode embedded|standalone]
        [--endpoint SOCK] [--load-async 0|1] [--key-namespace NS] [--engine-id ID]
        [--extra JSON] [--no-connector] [--no-module-path] [--mp] [--kv-events ENDPOINT]
        [--commands run,reset,run]

It starts the engine, prints a `ready` record, then executes commands (from --commands, else
one per stdin line) and prints one JSON record per command:

    run [TAG]   generate the test prompt greedily -> tokens, num_cached_tokens, seconds
    batch [TAG] generate --prompts distinct prompts at once (seeds PROMPT_SEED, +1, ...)
                -> tokens (one list per prompt), num_cached_tokens (per prompt), seconds
    reset       llm.reset_prefix_cache(), retried (see below) -> ok, tries
    reset_all   the same with reset_connector=True (the pool forgets this engine's KV too),
                then a 1-token request so that the next step carries the reset to the workers
    metrics     vLLM's prefix-cache counters (local and external)
    hashes      the prompt's vLLM block hashes (hex), as the connector sees them
    quit        exit 0

Records are single lines prefixed with `@@UMBP@@ ` (vLLM logs to stdout too). A failure
prints an `error` record and exits 1 (e.g. a standalone pool that is not reachable).

Why `reset` retries: in one-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0) the engine only
steps inside `generate`, so a finished request whose blocks the connector still holds (stores
in flight) keeps them until the next step, and `reset_prefix_cache()` returns False. A
one-token dummy request advances the engine; then the reset succeeds.

Also importable: `prompt_token_ids()` and `block_hashes()` (used by tests to compute keys).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARK = "@@UMBP@@ "

PROMPT_SEED = 7
PROMPT_LEN = 300  # two full 128-token blocks and a partial one
BLOCK_SIZE = 128  # vLLM's CPU default


def prompt_token_ids(seed: int = PROMPT_SEED, length: int = PROMPT_LEN) -> list[int]:
    """The deterministic test prompt (token ids within the tiny model's trained vocab)."""
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(length)]


def block_hashes(tokens: list[int], block_size: int = BLOCK_SIZE, algo: str = "sha256") -> list[bytes]:
    """vLLM's prefix-cache hashes of the full blocks of `tokens` (no LoRA/mm/salt).

    Same computation as the engine (`hash_block_tokens` chained from NONE_HASH). With a
    cryptographic hash and PYTHONHASHSEED unset, NONE_HASH is derived from a fixed seed, so
    every process agrees.
    """
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    out: list[bytes] = []
    parent = None
    for i in range(len(tokens) // block_size):
        parent = kcu.hash_block_tokens(fn, parent, tokens[i * block_size : (i + 1) * block_size], None)
        out.append(bytes(parent))
    return out


def emit(rec: dict) -> None:
    sys.stdout.write(MARK + json.dumps(rec) + "\n")
    sys.stdout.flush()


def emit_error(phase: str, e: BaseException) -> None:
    """The error record of an exception in `phase` ("startup" or a command), with the end of
    its traceback."""
    emit({"event": "error", "phase": phase, "error": f"{type(e).__name__}: {e}",
          "traceback": traceback.format_exc()[-4000:]})


def prefix_cache_metrics(llm) -> dict:
    """vLLM's prefix-cache metrics by name (the `metrics` command of both drivers)."""
    return {m.name: getattr(m, "value", None) for m in llm.get_metrics() if "prefix_cache" in m.name}


def serve(commands, handlers: dict) -> int:
    """The drivers' command loop: each `(name, arg)` of `commands` runs `handlers[name](arg)`
    and its record is emitted; `quit` ends the loop. An unknown command or a failed one is
    an error record and exit status 1 (the test reads why); the end is a `bye` record."""
    for name, arg in commands:
        if name == "quit":
            break
        try:
            handler = handlers.get(name)
            if handler is None:
                raise ValueError(f"unknown command {name!r}")
            emit(handler(arg))
        except Exception as e:  # noqa: BLE001
            emit_error(name, e)
            return 1
    emit({"event": "bye"})
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["embedded", "standalone"], default="embedded")
    ap.add_argument("--endpoint", default=None)
    ap.add_argument("--load-async", type=int, choices=[0, 1], default=None)
    ap.add_argument("--key-namespace", default=None)
    ap.add_argument("--engine-id", default=None)
    ap.add_argument("--kv-role", default="kv_both")
    ap.add_argument("--failure-policy", default="recompute", choices=["recompute", "fail"],
                    help="kv_load_failure_policy")
    ap.add_argument("--extra", default=None, help="JSON merged into kv_connector_extra_config")
    ap.add_argument("--no-connector", action="store_true", help="plain vLLM (reference output)")
    ap.add_argument("--no-module-path", action="store_true",
                    help="no kv_connector_module_path (the seed's config: vLLM finds the "
                         "connector through the umbp package's vllm.general_plugins entry point)")
    ap.add_argument("--mp", action="store_true", help="multi-process engine")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt-seed", type=int, default=PROMPT_SEED)
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    ap.add_argument("--commands", default=None, help="comma-separated; default: read stdin")
    ap.add_argument("--prompts", type=int, default=4, help="prompts of the batch command")
    ap.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                    help="publish KV cache events through vLLM's zmq publisher bound at ENDPOINT")
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="KV cache blocks (num_gpu_blocks_override): small to force preemption")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.mp else "0"
    if args.mp:
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

    t0 = time.monotonic()
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        kw: dict = dict(
            model=args.model,
            dtype="bfloat16",
            enable_prefix_caching=True,
            enforce_eager=True,
            max_model_len=1024,
            seed=0,
            disable_log_stats=False,
        )
        if args.num_gpu_blocks:
            kw["num_gpu_blocks_override"] = args.num_gpu_blocks
        if args.kv_events:
            kw["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": args.kv_events}
        if not args.no_connector:
            extra: dict = {"mode": args.mode}
            if args.endpoint:
                extra["endpoint"] = args.endpoint
            if args.load_async is not None:
                extra["load_async"] = bool(args.load_async)
            if args.key_namespace:
                extra["key_namespace"] = args.key_namespace
            if args.mode == "embedded":
                extra.setdefault("capacity_bytes", "256MiB")
            if args.extra:
                extra.update(json.loads(args.extra))
            ktc: dict = {
                "kv_connector": "UMBPStoreConnector",
                "kv_connector_module_path": "umbp.vllm",
                "kv_role": args.kv_role,
                "kv_load_failure_policy": args.failure_policy,
                "kv_connector_extra_config": extra,
            }
            if args.no_module_path:
                del ktc["kv_connector_module_path"]
            if args.engine_id:
                ktc["engine_id"] = args.engine_id
            kw["kv_transfer_config"] = ktc
        llm = LLM(**kw)
    except Exception as e:  # noqa: BLE001 - report, don't hang the test
        emit_error("startup", e)
        return 1
    emit({"event": "ready", "startup_s": round(time.monotonic() - t0, 2), "pid": os.getpid()})

    tokens = prompt_token_ids(args.prompt_seed, args.prompt_len)
    prompt = TokensPrompt(prompt_token_ids=tokens)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(tag: str) -> dict:
        t = time.monotonic()
        (o,) = llm.generate([prompt], sp, use_tqdm=False)
        return {"cmd": "run", "tag": tag, "tokens": list(o.outputs[0].token_ids),
                "num_cached_tokens": o.num_cached_tokens, "seconds": round(time.monotonic() - t, 3)}

    dummy = TokensPrompt(prompt_token_ids=[tokens[0]])
    batch_prompts = [TokensPrompt(prompt_token_ids=prompt_token_ids(args.prompt_seed + i, args.prompt_len))
                     for i in range(args.prompts)]

    def batch(tag: str) -> dict:
        t = time.monotonic()
        outs = llm.generate(batch_prompts, sp, use_tqdm=False)
        return {"cmd": "batch", "tag": tag, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "num_cached_tokens": [o.num_cached_tokens for o in outs],
                "seconds": round(time.monotonic() - t, 3)}

    def reset(connector: bool = False) -> dict:
        name = "reset_all" if connector else "reset"
        for tries in range(1, 11):
            if llm.reset_prefix_cache(reset_connector=connector):
                if connector:
                    llm.generate([dummy], SamplingParams(max_tokens=1), use_tqdm=False)
                return {"cmd": name, "ok": True, "tries": tries}
            llm.generate([dummy], SamplingParams(max_tokens=1), use_tqdm=False)
            time.sleep(0.05 * tries)
        return {"cmd": name, "ok": False, "tries": 10}

    source = args.commands.split(",") if args.commands else sys.stdin
    commands = ((parts[0], parts[1] if len(parts) > 1 else "") for parts in map(str.split, source) if parts)
    return serve(commands, {
        "run": run,
        "batch": batch,
        "reset": lambda _: reset(),
        "reset_all": lambda _: reset(connector=True),
        "metrics": lambda _: {"cmd": "metrics", "metrics": prefix_cache_metrics(llm)},
        "hashes": lambda _: {"cmd": "hashes", "hashes": [h.hex() for h in block_hashes(tokens)]},
    })


if __name__ == "__main__":
    sys.exit(main())
