"""The connector's scheduler half against a standalone `umbp-pool` that dies and comes back,
and its start-up checks (sched_harness.py: a real vLLM `Scheduler`, a worker-role connector
on real CPU KV tensors, the real binding; no model runs).

- While the pool is down a lookup is a miss that returns at once: the scheduler thread
  never waits on the pool (before: each re-attach built an `Index` whose connect retried
  for `lookup_timeout_ms`, ~1 s, on the scheduler thread).
- Once the pool is back, the index re-attaches by itself and lookups hit again.
- `kv_load_failure_policy` other than "recompute" is warned about at start.
"""

from __future__ import annotations

import logging
import time

import pytest

from conftest import harness_factory

pytestmark = pytest.mark.timeout(300)

BLOCK = 128


@pytest.fixture
def make(cfg_dir, native):
    yield from harness_factory(cfg_dir)


def T(seed, n=300):
    from sched_harness import tokens

    return tokens(seed, n)


def test_lookup_never_waits_while_the_standalone_pool_is_down(make, pool_factory):
    pool = pool_factory("sched-down")
    extra = {"mode": "standalone", "endpoint": str(pool.socket_path), "key_namespace": "pool-down"}
    h = make(extra=extra)
    h.add("a", T(1))
    h.run()
    h.reset_local_cache()
    b = h.request("b", T(1))
    assert h.conn.get_num_new_matched_tokens(b, 0) == (2 * BLOCK, True)

    pool.kill()
    # Lookups for 3 s (past the old 1 s re-attach interval and its backoff): every one a
    # miss, none waiting on the absent pool.
    took = []
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        t = time.perf_counter()
        r = h.conn.get_num_new_matched_tokens(b, 0)
        took.append(time.perf_counter() - t)
        assert r == (0, False)
        time.sleep(0.01)
    print(f"lookups while the pool is down: {len(took)}, max {max(took) * 1e3:.2f} ms, "
          f"median {sorted(took)[len(took) // 2] * 1e3:.3f} ms")
    assert len(took) > 50
    assert max(took) < 0.05, f"a lookup waited {max(took) * 1e3:.0f} ms on the dead pool"

    # Back: the restarted pool is empty; once the prompt is stored again the same index
    # (re-attached by itself, without waiting) finds it. (A store right after the restart
    # can be answered "not stored"; the prompt is then stored again by a new request.)
    pool.start()
    deadline = time.monotonic() + 30
    took = []
    for i in range(1000):
        h.add(f"c{i}", T(1))
        h.run(timeout=60)
        h.reset_local_cache()
        t = time.perf_counter()
        r = h.conn.get_num_new_matched_tokens(b, 0)
        took.append(time.perf_counter() - t)
        if r == (2 * BLOCK, True):
            break
        assert time.monotonic() < deadline, (
            f"no hit after the pool came back: {r}; index connected: "
            f"{h.conn._sched._indexes[0].connected}; pool: {pool.report()['pool']}; "
            f"connector: {h.connector_stats()}"
        )
        time.sleep(0.2)
    # The first lookups after the restart include the (non-waiting) re-attach, which maps
    # and faults in the new index: bounded by that, not by any timeout.
    assert max(took) < 0.5, f"a lookup took {max(took) * 1e3:.0f} ms while re-attaching"


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("policy,warned", [("fail", True), ("recompute", False)])
def test_warns_when_load_failures_fail_requests(make, policy, warned):
    cap = _Capture()
    loggers = [logging.getLogger(n) for n in ("vllm.umbp.connector", "umbp.vllm.connector")]
    for lg in loggers:
        lg.addHandler(cap)
    try:
        make(extra={"capacity_bytes": "16MiB"}, failure_policy=policy)
    finally:
        for lg in loggers:
            lg.removeHandler(cap)
    hits = [line for line in cap.lines if "kv_load_failure_policy" in line]
    assert bool(hits) == warned, cap.lines
    if warned:
        assert len(hits) == 1, hits  # once per engine (the scheduler role), not per worker
        assert "'fail'" in hits[0] and "recompute" in hits[0]
