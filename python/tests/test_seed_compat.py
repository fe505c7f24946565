"""A seed user's first hour (issue #33 items 1, 2, 3, 7, 10), without an engine:

- endpoints: the binding's `parse_endpoint` is the one parser (`umbp_ipc::endpoint`) the
  daemon, the Rust worker and scheduler and ringtool use: same values, same messages;
- the `vllm.general_plugins` entry point registers `UMBPStoreConnector` lazily, twice
  without harm, and importing it costs nothing beyond the registration;
- embedded `lookup_instance` is accepted with the seed's meaning (it separates engines:
  their workers' sockets differ);
- a request whose load failed may hit again after it was preempted (real vLLM Scheduler);
- item 10: `save_decode_cache` and `enable_lookup=false` do what the seed says.

The engines that run the seed's configs verbatim are in test_seed_config_e2e.py."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib

import pytest

from conftest import PY_DIR, harness_factory, options_fail as fails, parse_options as parse, require

pytest.importorskip("vllm")

pytestmark = [pytest.mark.usefixtures("clean_connector_env"), pytest.mark.timeout(300)]

ONLY_UNIX = "only unix sockets are supported (give a socket path or unix:///path/to/umbp.sock)"


# -- item 1: one endpoint parser -------------------------------------------------------------


@pytest.mark.parametrize("value,path", [("unix:///run/umbp/node.sock", "/run/umbp/node.sock"),
                                        ("/run/umbp/pool.sock", "/run/umbp/pool.sock")])
def test_binding_parses_endpoints_like_the_rust_readers(native, value, path):
    assert native.parse_endpoint("endpoint", value) == path


@pytest.mark.parametrize("value,what", [("tcp://127.0.0.1:5555", "is a tcp address"),
                                        ("localhost:8000", "looks like a TCP host:port")])
def test_refusals_carry_the_shared_message(native, value, what):
    with pytest.raises(ValueError) as e:
        native.parse_endpoint("endpoint", value)
    assert str(e.value) == f"endpoint: '{value}' {what}; {ONLY_UNIX}"
    # The connector's config says exactly what the binding (and umbp-pool, ringtool) says.
    assert fails({"mode": "standalone", "endpoint": value}, "endpoint") == str(e.value)


def test_seed_env_address_reaches_workers_and_indexes(native, short_tmp, monkeypatch):
    """`UMBP_STANDALONE_ADDRESS=unix:///...` (the seed guide's form) as the binding's default
    socket; Worker and Index take the unix:// form directly too."""
    sock = short_tmp / "p.sock"
    monkeypatch.setenv("UMBP_STANDALONE_ADDRESS", f"unix://{sock}")
    assert native.default_socket_path() == str(sock)
    pool = native.EmbeddedPool(8 << 20, socket_path=str(sock))
    try:
        w = native.Worker(f"unix://{sock}", b"\0" * 16, startup_timeout_ms=2000)
        assert w.connected
        w.close()
        idx = native.Index(f"unix://{sock}", namespace=b"\0" * 16, timeout_ms=2000)
        assert idx.connected
    finally:
        pool.close()
    monkeypatch.setenv("UMBP_STANDALONE_ADDRESS", "tcp://10.0.0.1:9000")
    with pytest.raises(ValueError, match="UMBP_STANDALONE_ADDRESS: 'tcp://10.0.0.1:9000' is a tcp address; .*"):
        native.default_socket_path()
    for cls in (native.Worker, native.Index):
        with pytest.raises(ValueError, match="endpoint: 'tcp://x:1' is a tcp address"):
            cls("tcp://x:1", b"\0" * 16)


# -- item 2: the vllm.general_plugins entry point -----------------------------------------------


def test_pyproject_declares_the_plugin():
    eps = tomllib.loads((PY_DIR / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {"umbp": "umbp._vllm_plugin:register"}


def test_installed_package_exposes_the_plugin():
    """What vLLM's plugin loader sees (needs the umbp wheel installed; CI installs it)."""
    try:
        importlib.metadata.distribution("umbp")
    except importlib.metadata.PackageNotFoundError:
        require(False, "the umbp wheel is not installed (scripts/build-wheel.sh --install)")
    eps = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert eps.get("umbp") == "umbp._vllm_plugin:register", eps


def test_register_is_lazy_and_idempotent():
    """In a fresh interpreter: vLLM's own plugin loading (which runs our entry point where
    the wheel is installed) plus two more explicit calls; the name resolves to our class
    only when asked, and neither `umbp.vllm` nor the native module is imported before."""
    code = r"""
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
import umbp._vllm_plugin as p
p.register(); p.register()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
assert "UMBPStoreConnector" in KVConnectorFactory._registry
heavy = sorted(m for m in ("umbp.vllm", "umbp._native") if m in sys.modules)
assert not heavy, f"registration imported {heavy}"
cls = KVConnectorFactory.get_connector_class_by_name("UMBPStoreConnector")
import umbp.vllm
assert cls is umbp.vllm.UMBPStoreConnector, cls
print("OK")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                       cwd=str(PY_DIR.parent))
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-2000:] + r.stderr[-4000:]


# -- item 3: embedded lookup_instance ----------------------------------------------------------


def test_embedded_lookup_instance_is_accepted():
    c = parse({"mode": "embedded", "lookup_instance": "engine-a"})
    assert c.embedded and c.instance == "engine-a" and c.lookup_instance is None
    assert parse({"lookup_instance": 7}).instance == "7"
    for bad in ("", "  ", ["a"], True):
        fails({"lookup_instance": bad}, "lookup_instance")


def test_lookup_instance_separates_engine_sockets(tmp_path):
    from umbp.vllm.endpoints import embedded_socket_path

    def path(instance):
        return embedded_socket_path("/x/d.sock", "same-engine-id", 0, 1, lookup_dir=str(tmp_path),
                                    instance=instance)

    # Two engines given the same engine_id are told apart by lookup_instance; each side of
    # one engine (scheduler, workers) derives the same path; no instance: as before.
    assert path("a") != path("b") and path("a") == path("a")
    assert path(None) == embedded_socket_path("/x/d.sock", "same-engine-id", 0, 1, lookup_dir=str(tmp_path))
    assert path("a") != path(None) and path("a").endswith("-dp0-tp1.sock")


@pytest.fixture
def make(cfg_dir, native):
    yield from harness_factory(cfg_dir, {"capacity_bytes": "16MiB", "key_namespace": "seed-compat"})


def test_embedded_lookup_instance_reaches_the_workers_pools(make):
    """Scheduler and worker of one engine agree on the instance's socket: a stored prompt
    is found again through the scheduler's index."""
    from sched_harness import tokens

    from umbp.vllm.endpoints import embedded_socket_path

    h = make(extra={"lookup_instance": "seed-engine-a"})
    sock = h.worker._worker.endpoint
    assert sock == embedded_socket_path(h.conn._native.default_socket_path(), h.engine_id, 0, 0,
                                        instance="seed-engine-a")
    assert sock != embedded_socket_path(h.conn._native.default_socket_path(), h.engine_id, 0, 0)
    h.store_and_forget("a", tokens(31, 300))
    h.add("b", tokens(31, 300))
    h.run()
    assert h.external_tokens("b") == 256


# -- item 7: a failed load does not bar a request from hits for good --------------------------


def test_request_hits_again_after_a_failed_load_and_a_preemption(make, native):
    """b's async load fails (the objects vanish between lookup and load): b recomputes and
    stores its prompt again; vLLM then preempts b (reset_prefix_cache with running
    requests, which also empties vLLM's own cache): b's next lookup is a pool hit again
    and restores the exact bytes. (Right after the failure, vLLM's immediate re-lookup
    misses: that is the no-retry-loop rule.)"""
    from sched_harness import tokens

    h = make(extra={"load_async": True})
    h.store_and_forget("a", tokens(32, 300))
    b = h.add("b", tokens(32, 300), max_tokens=64)

    def drop_objects(so):
        w = native.Worker(h.worker._worker.endpoint, native.namespace_digest("seed-compat"))
        assert w.reset_namespace() == 2
        w.close()

    so = h.step(before_worker=drop_objects)
    assert [op.req_id for op in so.kv_connector_metadata.loads] == ["b"]
    # b recomputes past its prompt; its recomputed blocks are stored again.
    h.step_until(lambda: b.num_computed_tokens > 300)
    h.step_until(lambda: h.pool_report()["pool"]["published_objects"] >= 2)
    assert h.connector_stats()["load_failed_blocks"] == 2
    assert b.num_preemptions == 0

    assert h.sched.reset_prefix_cache(reset_running_requests=True)
    h.kv_buffer.zero_()
    assert b.num_preemptions == 1 and b.num_computed_tokens == 0
    so = h.step()
    loads = [op for op in so.kv_connector_metadata.loads if op.req_id == "b"]
    assert loads and loads[0].hashes == [bytes(x) for x in b.block_hashes[:2]], "no pool hit after the preemption"
    h.step_until(lambda: b.num_computed_tokens > 300)
    assert h.holds_blocks_of(b, h.block_ids("b"), 2)
    h.run()
    assert h.connector_stats()["loaded_blocks"] >= 2


def test_a_preempted_request_that_stored_loads_async_and_is_freed_once(make):
    """A request that stored its prompt and was preempted hits the pool again with an
    asynchronous load (under kv_load_failure_policy=recompute loads are always async, so
    refusing async loads to requests that stored would cost every preempted request its
    hits). Aborted while that load is in flight, it is reported "received" only, never
    also "sent": vLLM frees its blocks exactly once and the engine goes on."""
    from sched_harness import tokens
    from vllm.v1.request import RequestStatus

    h = make()
    b = h.add("b", tokens(34, 300), max_tokens=64)
    h.step_until(lambda: b.num_computed_tokens > 300)
    h.step_until(lambda: h.pool_report()["pool"]["published_objects"] >= 2)
    assert h.sched.reset_prefix_cache(reset_running_requests=True)
    h.kv_buffer.zero_()
    assert b.num_preemptions == 1

    reports = {"sending": set(), "recving": set()}
    get_finished = h.worker.get_finished

    def spy(finished):
        sending, recving = get_finished(finished)
        reports["sending"] |= sending or set()
        reports["recving"] |= recving or set()
        return sending, recving

    h.worker.get_finished = spy
    free_before = h.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def abort_b(so):
        h.sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)

    so = h.step(before_worker=abort_b)
    loads = [op for op in so.kv_connector_metadata.loads if op.req_id == "b"]
    assert loads and all(op.is_async for op in loads), "the preempted request got no (async) pool hit"
    h.step_until(lambda: "b" not in h.sched.requests)
    for _ in range(5):
        h.step()
    assert reports["recving"] == {"b"} and reports["sending"] == set(), reports
    assert h.sched.kv_cache_manager.block_pool.get_num_free_blocks() == free_before, "b's blocks not freed"
    # The engine goes on: a new request with the same prompt is served from the pool.
    h.add("c", tokens(34, 300))
    h.run()
    assert h.external_tokens("c") == 256


def test_failed_loads_are_bounded(make, native):
    """Every reload fails (objects dropped each time): after _MAX_FAILED_LOADS failures the
    request is not offered the pool again, even after preemptions."""
    from sched_harness import tokens

    from umbp.vllm import scheduler_side as S

    h = make(extra={"load_async": True})
    b_tokens = tokens(33, 300)
    h.store_and_forget("a", b_tokens)
    b = h.add("b", b_tokens, max_tokens=400)

    def drop_objects(so):
        if any(op.req_id == "b" for op in so.kv_connector_metadata.loads):
            w = native.Worker(h.worker._worker.endpoint, native.namespace_digest("seed-compat"))
            w.reset_namespace()
            w.close()

    loads = 0
    for _ in range(S._MAX_FAILED_LOADS + 1):
        so = h.step(before_worker=drop_objects)  # b's lookup (after a preemption but the first)
        loads += any(op.req_id == "b" for op in so.kv_connector_metadata.loads)
        h.step_until(lambda: b.num_computed_tokens > 300)  # recomputed
        h.step_until(lambda: h.pool_report()["pool"]["published_objects"] >= 2)  # and stored again
        assert h.sched.reset_prefix_cache(reset_running_requests=True)  # preempts b
        h.kv_buffer.zero_()
    assert loads == S._MAX_FAILED_LOADS
    assert h.conn._sched._reqs["b"].load_failures == S._MAX_FAILED_LOADS


# -- item 10: the seed's save_decode_cache and enable_lookup=false, verified ----------------


def _decode_then_prompt(make, extra):
    """Request a (300-token prompt) generates 100 tokens (the harness samples token 7), so
    its third 128-token block is filled by generated tokens. vLLM's own cache is emptied;
    then request b's prompt is a's whole text, prompt and output. Returns (b's tokens taken
    from the connector, objects in the pool)."""
    from sched_harness import tokens

    h = make(extra=extra)
    prompt = tokens(40, 300)
    a = h.add("a", prompt, max_tokens=100)
    h.run()
    text = prompt + list(a.output_token_ids)
    assert len(text) == 400
    h.step_until(lambda: h.pool_report()["pool"]["published_objects"] >= (3 if extra.get("save_decode_cache") else 2))
    objects = h.pool_report()["pool"]["published_objects"]
    h.reset_local_cache()
    h.add("b", text)
    h.run()
    return h.external_tokens("b"), objects


def test_save_decode_cache_stores_blocks_filled_by_generated_tokens(make):
    """The seed's `save_decode_cache`: on, the block filled by generated tokens is stored and
    a later prompt that continues the conversation hits it (3 blocks, 384 tokens); off (the
    default), only the prompt's 2 full blocks are in the pool."""
    hit_on, objects_on = _decode_then_prompt(make, {"save_decode_cache": True})
    hit_off, objects_off = _decode_then_prompt(make, {})
    assert (hit_on, objects_on) == (384, 3), "save_decode_cache=true: the decode block is stored and hit"
    assert (hit_off, objects_off) == (256, 2), "default: prompt blocks only"


def test_enable_lookup_false_stores_but_never_reports_a_hit(make):
    """The seed's `enable_lookup=false`: the engine stores (the pool fills) but is never
    offered a hit, so nothing is loaded; the same engine with lookups on hits."""
    from sched_harness import tokens

    h = make(extra={"enable_lookup": False})
    h.store_and_forget("a", tokens(41, 300))
    assert h.pool_report()["pool"]["published_objects"] == 2, "stores still happen"
    h.add("b", tokens(41, 300))
    h.run()
    assert h.external_tokens("b") == 0
    assert h.connector_stats().get("loaded_blocks", 0) == 0
    h2 = make()
    h2.store_and_forget("a", tokens(42, 300))
    h2.add("b", tokens(42, 300))
    h2.run()
    assert h2.external_tokens("b") == 256, "the control: lookups on hit"
