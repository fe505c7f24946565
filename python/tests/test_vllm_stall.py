"""A stalled pool must never yield a wrong token nor stop the engine (issue: cancel, never
abandon). A real vLLM CPU engine with a KV cache too small for its four concurrent
requests (vLLM preempts some and hands their blocks to the others) runs against a
standalone `umbp-pool` that is SIGSTOPped during the requests' prefill and stores, and
SIGCONTed a few seconds later.

Before the cancel contract, the connector dropped transfers past `timeout_ms` while the
pool still held them: the resumed pool copied the new owners' KV and published it under
the preempted request's prefix keys, and a later run of that prompt loaded foreign KV and
produced different tokens. And blocks held by never-answered stores stopped the engine
until the pool resumed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROMPTS = 4
PROMPT_LEN = 250  # two blocks of 128; decoding crosses into a third: preemption
MAX_TOKENS = 16
# 4 requests x 2 blocks fill the cache; each needs a third block to decode.
NUM_BLOCKS = 9
STALL_S = 5.0
TIMEOUT_MS = 1000


def engine_args(*extra: str) -> list[str]:
    return ["--prompts", str(PROMPTS), "--prompt-len", str(PROMPT_LEN), "--max-tokens", str(MAX_TOKENS),
            "--num-gpu-blocks", str(NUM_BLOCKS), *extra]


def test_stalled_pool_never_changes_output_nor_stops_the_engine(native, pool_factory, engine_factory):
    ref = engine_factory(*engine_args("--no-connector"), name="reference")
    reference = ref.cmd("batch reference", timeout=300)["tokens"]
    assert ref.close() == 0
    assert len(reference) == PROMPTS and all(len(t) == MAX_TOKENS for t in reference)

    pool = pool_factory()
    extra = '{"timeout_ms": %d, "load_async": false}' % TIMEOUT_MS
    eng = engine_factory(*engine_args("--mode", "standalone", "--endpoint", str(pool.socket_path),
                                      "--extra", extra), name="stall")
    # Stopped before the requests' prefill; resumed while the engine may still run them.
    pool.pause()
    resumer = threading.Timer(STALL_S, pool.resume)
    resumer.start()
    try:
        stalled = eng.cmd("batch during-stall", timeout=300)
    finally:
        resumer.cancel()
        pool.resume()
    assert stalled["tokens"] == reference, "a stalled pool changed the output"
    # The engine kept serving: at most one timeout per step that waits on the pool, not
    # the whole stall per blocked request.
    assert stalled["seconds"] < 120, stalled

    # Let the resumed pool finish what it had started, then serve everything from the pool
    # (vLLM's own prefix cache is reset): whatever was published must be the right KV.
    time.sleep(2.0)
    restored = 0
    for attempt in range(3):
        eng.reset()
        again = eng.cmd(f"batch after-resume-{attempt}", timeout=300)
        assert again["tokens"] == reference, (
            f"output after the stall differs (attempt {attempt}, cached {again['num_cached_tokens']})")
        restored += sum(again["num_cached_tokens"])
    assert restored > 0, "no prompt was served from the pool: the check saw nothing"
    report = pool.report()
    assert report["pool"]["published_objects"] > 0, "nothing was stored at all: the test saw nothing"
    assert eng.close() == 0


LOOKUP_TIMEOUT_MS = 300


def test_stopped_pool_is_a_miss_under_the_fail_policy(native, pool_factory, engine_factory):
    """Issue #33 item 6: with vLLM's default kv_load_failure_policy=fail, a prompt the pool
    holds is served (as a miss, recomputed) while the pool is SIGSTOPped: lookups miss once
    the pool's heartbeat is lookup_timeout_ms old, so no load is planned that the stopped
    pool would refuse. (Before the heartbeat the lookup hit, the load timed out after
    timeout_ms and the request failed.)"""
    pool = pool_factory()
    extra = '{"timeout_ms": %d, "lookup_timeout_ms": %d, "load_async": false}' % (TIMEOUT_MS, LOOKUP_TIMEOUT_MS)
    eng = engine_factory("--mode", "standalone", "--endpoint", str(pool.socket_path), "--failure-policy", "fail",
                         "--extra", extra, "--max-tokens", "4", name="stall-fail")
    first = eng.cmd("run store", timeout=300)
    eng.reset()
    hit = eng.cmd("run from-pool", timeout=300)
    assert hit["tokens"] == first["tokens"] and hit["num_cached_tokens"] > 0, "the pool did not serve the prompt"
    eng.reset()
    pool.pause()
    try:
        time.sleep(3 * LOOKUP_TIMEOUT_MS / 1000)
        stalled = eng.cmd("run during-stall", timeout=300)
    finally:
        pool.resume()
    assert stalled["tokens"] == first["tokens"], f"request not served while the pool was stopped: {stalled}"
    assert stalled["num_cached_tokens"] == 0, stalled
    assert stalled["seconds"] < TIMEOUT_MS / 1000, f"the request waited on the stopped pool: {stalled}"
    # Running again, the pool serves hits again.
    eng.reset()
    time.sleep(0.2)
    again = eng.cmd("run after-resume", timeout=300)
    assert again["tokens"] == first["tokens"] and again["num_cached_tokens"] > 0, again
    assert eng.close() == 0
