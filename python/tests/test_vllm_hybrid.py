"""Hybrid KV cache models, lazy offload and partial hash hits on real vLLM CPU engines.

Each engine runs in its own process (`offload_driver.py`), one at a time. Models are built
locally: `tiny_hybrid.py` (Gemma-2-like: sliding-window and full-attention layers, so vLLM's
hybrid KV cache manager gives it two KV cache groups) and `tiny_model.py` (Qwen2).

Prompts are 700 tokens: 5 full 128-token blocks and a partial one; a full restore means
`num_cached_tokens == 640` after vLLM's own prefix cache was emptied (or evicted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _ADD_PY_DIR

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TESTS = Path(__file__).resolve().parent
PY_DIR = TESTS.parent
MARK = "@@UMBP@@ "
FULL = 640  # 5 full blocks of a 700-token prompt


def drive(model: str, commands: list[str], *args: str, log: Path, timeout: float = 600) -> list[dict]:
    """Run offload_driver.py to the end; its records (an error record fails the test)."""
    env = dict(os.environ)
    # The source tree only where umbp is not installed (a source tree has no _native module).
    path = [str(TESTS)] + ([str(PY_DIR)] if _ADD_PY_DIR else []) + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, "-u", str(TESTS / "offload_driver.py"), "--model", model,
           "--commands", ",".join(commands), *args]
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    text = log.read_text(errors="replace")
    recs = [json.loads(line[len(MARK):]) for line in text.splitlines() if line.startswith(MARK)]
    errors = [r for r in recs if r.get("event") == "error"]
    assert p.returncode == 0 and not errors, f"driver failed ({p.returncode}): {errors}\n{text[-4000:]}"
    return [r for r in recs if "cmd" in r]


@pytest.fixture(scope="module")
def gemma2(vllm_ok) -> str:
    from tiny_hybrid import build_tiny_hybrid

    return build_tiny_hybrid("gemma2")


def test_sliding_window_hybrid_restores_identical_tokens(gemma2, native, tmp_path):
    """Gemma-2-like model with the hybrid KV cache manager on (full attention + sliding
    window groups): a prompt restored from the pool gives the tokens of plain vLLM."""
    (ref,) = drive(gemma2, ["run:7"], "--no-connector", log=tmp_path / "ref.log")
    recs = drive(gemma2, ["run:7", "reset", "run:7", "run:8", "metrics", "totals"], log=tmp_path / "con.log")
    cold, reset, warm, other, metrics, totals = recs
    # vLLM kept its hybrid KV cache manager: two groups, one of them sliding-window.
    assert sorted(k for _, k, _ in totals["groups"]) == ["full", "sliding"], totals
    assert cold["num_cached_tokens"] == 0 and cold["tokens"] == ref["tokens"]
    assert reset["ok"]
    assert warm["num_cached_tokens"] == FULL, warm
    assert warm["tokens"] == ref["tokens"], "restored KV changed the output"
    assert metrics["metrics"].get("vllm:external_prefix_cache_hits", 0) >= FULL
    # Sliding-window group: only the blocks inside the window were loaded (1 or 2 of the
    # 5), plus the full-attention group's 5.
    assert 5 < totals["loaded_blocks"] < 10, totals
    assert totals["pinned_ops"] == 0, "pinned sliding-window blocks were never released"
    assert other["num_cached_tokens"] == 0


def test_lazy_offload_restores_evicted_prompt(tiny_model, native, tmp_path):
    """lazy_offload: nothing is stored after each step; blocks are stored from vLLM's free
    queue before they are evicted. Prompt 7 is pushed out of a 40-block KV cache by nine
    other prompts (prompt 12, used between each, stays in vLLM's cache), then comes back:
    restored from the pool, same tokens. Eager offload on the same workload is measured for
    comparison (stored bytes)."""
    others = [8, 9, 10, 11, 13, 14, 15, 16, 17]
    work = ["run:7"] + [f"run:{s}" for o in others for s in (12, o)] + ["run:7", "metrics", "totals"]
    (ref,) = drive(tiny_model, ["run:7"], "--no-connector", log=tmp_path / "ref.log")
    blocks = ["--num-gpu-blocks", "40"]
    lazy_cfg = {"lazy_offload": True, "lazy_offload_max_blocks": 8}
    lazy = drive(tiny_model, work, *blocks, "--extra", json.dumps(lazy_cfg), log=tmp_path / "lazy.log")
    eager = drive(tiny_model, work, *blocks, log=tmp_path / "eager.log")
    for name, recs in (("lazy", lazy), ("eager", eager)):
        first, back, metrics, totals = recs[0], recs[-3], recs[-2], recs[-1]
        assert first["tokens"] == ref["tokens"]
        assert back["num_cached_tokens"] == FULL, (name, back)
        assert back["tokens"] == ref["tokens"], f"{name}: restored KV changed the output"
        # vLLM's own cache had lost the prompt: the hit came through the connector.
        assert metrics["metrics"].get("vllm:external_prefix_cache_hits", 0) >= FULL, (name, metrics)
        assert totals["pinned_ops"] == 0, (name, totals)
    lt, et = lazy[-1], eager[-1]
    assert lt["lazy_stored_blocks"] > 0 and et["lazy_stored_blocks"] == 0
    assert lt["stored_bytes"] < et["stored_bytes"], (lt, et)
    print(
        f"\nMEASURE lazy_offload: 19 prompts of 700 tokens (10 distinct, one hot), 40-block KV "
        f"cache, lazy_offload_max_blocks=8: stored {lt['stored_blocks']} blocks / "
        f"{lt['stored_bytes']} bytes lazily vs {et['stored_blocks']} blocks / "
        f"{et['stored_bytes']} bytes eagerly"
    )


def test_partial_hash_hits_refused_where_vllm_cannot_hit_inside_a_block(tiny_model, native):
    """enable_partial_hash_hits on a model whose hits always land on block boundaries
    (one full-attention group): refused at start, naming the option and vLLM's version."""
    import vllm
    from sched_harness import Harness, config_only_model_dir

    with pytest.raises(ValueError) as e:
        Harness(config_only_model_dir(tiny_model), extra={"enable_partial_hash_hits": True})
    msg = str(e.value)
    assert "enable_partial_hash_hits" in msg and vllm.__version__ in msg, msg
    assert "prefix_match_unit" in msg, msg
