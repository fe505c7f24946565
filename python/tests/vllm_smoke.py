"""Smoke run of a real vLLM CPU engine with the probe connector (a script, not a test).

    .venv/bin/python python/tests/vllm_smoke.py [--async-load] [--mp] [--out DIR]

Builds the tiny model, starts `LLM(...)` with `_probe_connector.ProbeConnector` loaded through
`kv_connector_module_path`, and runs one ~2.3-block prompt three times:
  1. cold (the probe stores its full blocks after the forward),
  2. after `reset_prefix_cache()` (only the connector can supply the prefix: loads),
  3. again after `reset_prefix_cache()`, with the probe told to corrupt what it loads.
It prints one JSON summary (timings, tokens, num_cached_tokens, external-hit metrics) and
leaves the call log in `<out>/probe.jsonl` (one JSON line per connector call).

--mp keeps vLLM's default multi-process engine (EngineCore in a child process), to see which
process each connector role lives in; the default is one process
(VLLM_ENABLE_V1_MULTIPROCESSING=0).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tiny_model import build_tiny_model  # noqa: E402

PROMPT_LEN = 300  # 2 full blocks of 128 + a partial one


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--async-load", action="store_true")
    ap.add_argument("--mp", action="store_true", help="multi-process engine (default: one)")
    ap.add_argument("--out", default=None, help="directory for probe.jsonl and the store")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()

    out = Path(args.out or tempfile.mkdtemp(prefix="umbp-smoke-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "probe.jsonl"
    store = out / "store"
    log.unlink(missing_ok=True)
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.mp else "0"
    if args.mp:
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The engine core (maybe another process) must import the probe by module name.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )

    t0 = time.monotonic()
    model = build_tiny_model()
    t_model = time.monotonic() - t0

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_import = time.monotonic() - t0 - t_model
    kv_transfer_config = {
        "kv_connector": "ProbeConnector",
        "kv_connector_module_path": "_probe_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "probe_log": str(log),
            "probe_store_dir": str(store),
            "probe_load_async": args.async_load,
        },
    }
    t1 = time.monotonic()
    llm = LLM(
        model=model,
        dtype="bfloat16",
        enable_prefix_caching=True,
        enforce_eager=True,
        max_model_len=1024,
        kv_transfer_config=kv_transfer_config,
        disable_log_stats=False,
        seed=0,
    )
    t_start = time.monotonic() - t1

    rng = random.Random(7)
    prompt = TokensPrompt(prompt_token_ids=[rng.randrange(2, 1000) for _ in range(PROMPT_LEN)])
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def run(tag: str) -> dict:
        t = time.monotonic()
        (o,) = llm.generate([prompt], sp, use_tqdm=False)
        return {
            "tag": tag,
            "seconds": round(time.monotonic() - t, 3),
            "num_cached_tokens": o.num_cached_tokens,
            "tokens": list(o.outputs[0].token_ids),
        }

    runs = [run("cold")]
    llm.reset_prefix_cache()
    runs.append(run("restored"))
    (store / "CORRUPT").touch()
    llm.reset_prefix_cache()
    runs.append(run("restored-corrupted"))

    metrics = {}
    try:
        for m in llm.get_metrics():
            if "prefix_cache" in m.name:
                metrics[m.name] = getattr(m, "value", None)
    except Exception as e:  # noqa: BLE001
        metrics["error"] = repr(e)

    summary = {
        "mode": "mp" if args.mp else "one-process",
        "load_async": args.async_load,
        "seconds": {
            "build_model": round(t_model, 2),
            "import_vllm": round(t_import, 2),
            "engine_start": round(t_start, 2),
        },
        "runs": runs,
        "restored_equal": runs[0]["tokens"] == runs[1]["tokens"],
        "corrupted_differs": runs[0]["tokens"] != runs[2]["tokens"],
        "metrics": metrics,
        "log": str(log),
        "stored_blocks": sorted(p.name for p in store.glob("*.pt")),
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
