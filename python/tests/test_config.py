"""`kv_connector_extra_config` parsing (umbp.vllm.config): every key's accepted values,
sizes with units, and errors that name the key at fault. Pure Python, no pool, no engine."""

from __future__ import annotations

import pytest

from conftest import options_fail as fails, parse_options as parse

pytest.importorskip("vllm")  # umbp.vllm imports vLLM's connector base classes

from umbp.vllm import config as C  # noqa: E402

GiB = 1 << 30


pytestmark = pytest.mark.usefixtures("clean_connector_env")


# -- defaults and unknown keys --------------------------------------------------------


@pytest.mark.parametrize("extra", [None, {}])
def test_defaults(extra):
    c = parse(extra)
    assert c.mode == "embedded" and c.embedded
    assert (c.endpoint, c.lookup_instance, c.capacity_bytes, c.total_capacity_bytes) == (None,) * 4
    assert (c.dram_high_watermark, c.dram_low_watermark) == (0.9, 0.7)
    assert (c.load_async, c.lookup_async, c.enable_lookup, c.save_decode_cache) == (True, False, True, False)
    assert c.key_namespace is None
    assert (c.timeout_ms, c.lookup_timeout_ms, c.startup_timeout_ms) == (5000, 1000, 10000)


def test_every_documented_key_is_known():
    for key in C.KNOWN_KEYS:
        assert f"`{key}`" in C.__doc__, f"{key} is not documented in config.py"


@pytest.mark.parametrize("key", ["capacity", "Mode", "dram_capacity", "endpoints"])
def test_unknown_key_is_named(key):
    msg = fails({key: 1}, key)
    assert "unknown" in msg


def test_config_is_frozen():
    c = parse({})
    with pytest.raises(Exception):
        c.mode = "standalone"  # type: ignore[misc]


def test_none_means_absent():
    assert parse({"capacity_bytes": None, "timeout_ms": None}) == parse({})


# -- mode, endpoint, lookup_instance ---------------------------------------------------


@pytest.mark.parametrize("value,mode", [("embedded", "embedded"), ("standalone", "standalone"),
                                        (" Standalone ", "standalone"), ("EMBEDDED", "embedded")])
def test_mode_accepted(value, mode):
    assert parse({"mode": value}, lambda: "/x.sock").mode == mode


@pytest.mark.parametrize("value", ["shared", "", 1, {"x": 1}])
def test_mode_rejected(value):
    fails({"mode": value}, "mode")


def test_standalone_endpoint_resolution(monkeypatch):
    calls = []

    def default():
        calls.append(1)
        return "/default.sock"

    c = parse({"mode": "standalone", "endpoint": "/run/a.sock"}, default)
    assert (c.endpoint, c.lookup_instance) == ("/run/a.sock", "/run/a.sock") and not calls
    c = parse({"mode": "standalone", "endpoint": "/a.sock", "lookup_instance": "/b.sock"}, default)
    assert (c.endpoint, c.lookup_instance) == ("/a.sock", "/b.sock")
    monkeypatch.setenv(C.ENV_STANDALONE_ADDRESS, "/env.sock")
    assert parse({"mode": "standalone"}, default).endpoint == "/env.sock" and not calls
    monkeypatch.delenv(C.ENV_STANDALONE_ADDRESS)
    c = parse({"mode": "standalone"}, default)
    assert (c.endpoint, c.lookup_instance) == ("/default.sock", "/default.sock") and calls == [1]


@pytest.mark.parametrize("key", ["endpoint", "lookup_instance"])
@pytest.mark.parametrize("value", ["", 5, ["/a.sock"]])
def test_socket_paths_rejected(key, value):
    fails({"mode": "standalone", key: value}, key)


def test_endpoint_conflicts_with_embedded():
    msg = fails({"endpoint": "/a.sock"}, "endpoint")
    assert "standalone" in msg


# -- sizes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,expected",
    [
        ("64GiB", 64 * GiB), ("64GB", 64 * GiB), ("64G", 64 * GiB), ("64g", 64 * GiB),
        ("512MiB", 512 << 20), ("512 MiB", 512 << 20), ("1.5G", 3 * GiB // 2), ("1.5GiB", 3 * GiB // 2),
        ("2TiB", 2 << 40), ("4KiB", 4096), ("4k", 4096), ("4096", 4096), ("4096B", 4096),
        (4096, 4096), (4096.0, 4096), (" 8GiB ", 8 * GiB),
    ],
)
def test_sizes_accepted(value, expected):
    assert parse({"capacity_bytes": value}).capacity_bytes == expected
    assert parse({"total_capacity_bytes": value}).total_capacity_bytes == expected


@pytest.mark.parametrize("value", ["plenty", "64XB", "-1", "0", 0, -5, "1.5", 1.5, True, [1], "", "GiB"])
@pytest.mark.parametrize("key", ["capacity_bytes", "total_capacity_bytes"])
def test_sizes_rejected(key, value):
    fails({key: value}, key)


def test_sizes_agree_with_umbp_pool(native):
    """The connector parses sizes like umbp-pool (pool/src/config/) does."""
    for s in ["64GiB", "64GB", "64G", "512MiB", "4KiB", "4k", "4096", "2TiB", "1.5GiB"]:
        try:
            pool = native.parse_size("capacity_bytes", s)
        except ValueError:
            continue  # a form only the connector accepts is fine; disagreeing values are not
        assert C.parse_size(s) == pool, s


def test_capacity_conflict():
    msg = fails({"capacity_bytes": "1GiB", "total_capacity_bytes": "4GiB"}, "capacity_bytes")
    assert "total_capacity_bytes" in msg


def test_capacity_per_worker(monkeypatch):
    assert parse({"capacity_bytes": "3GiB"}).capacity_per_worker(4) == 3 * GiB
    assert parse({"total_capacity_bytes": "8GiB"}).capacity_per_worker(4) == 2 * GiB
    monkeypatch.setenv(C.ENV_DRAM_CAPACITY, "6GiB")
    assert parse({}).capacity_per_worker(2) == 6 * GiB  # per worker, like umbp-pool's own size
    monkeypatch.setenv(C.ENV_DRAM_CAPACITY, "lots")
    with pytest.raises(ValueError, match=C.ENV_DRAM_CAPACITY):
        parse({}).capacity_per_worker(1)
    monkeypatch.delenv(C.ENV_DRAM_CAPACITY)
    dflt = parse({}).capacity_per_worker(2)
    assert dflt >= GiB and dflt <= max(GiB, C._physical_memory_bytes() // 8)


@pytest.mark.parametrize("key", ["capacity_bytes", "total_capacity_bytes", "dram_high_watermark",
                                 "dram_low_watermark"])
def test_pool_sizing_keys_conflict_with_standalone(key):
    value = "1GiB" if "capacity" in key else 0.5
    msg = fails({"mode": "standalone", "endpoint": "/a.sock", key: value}, key)
    assert "embedded" in msg


# -- watermarks ------------------------------------------------------------------------


def test_watermarks():
    c = parse({"dram_high_watermark": 0.95, "dram_low_watermark": "0.5"})
    assert (c.dram_high_watermark, c.dram_low_watermark) == (0.95, 0.5)
    assert parse({"dram_high_watermark": 1}).dram_high_watermark == 1.0


@pytest.mark.parametrize("value", [0, 0.0, 1.5, -0.1, "high", True, {"x": 1}])
@pytest.mark.parametrize("key", ["dram_high_watermark", "dram_low_watermark"])
def test_watermarks_rejected(key, value):
    fails({key: value}, key)


def test_watermarks_must_be_ordered():
    fails({"dram_low_watermark": 0.9}, "dram_low_watermark")  # default high is 0.9
    fails({"dram_high_watermark": 0.6}, "dram_high_watermark")  # default low is 0.7
    fails({"dram_high_watermark": 0.5, "dram_low_watermark": 0.6}, "dram_low_watermark")


# -- booleans, integers, namespace ---------------------------------------------------------

BOOL_KEYS = ["load_async", "lookup_async", "enable_lookup", "save_decode_cache"]
INT_KEYS = ["timeout_ms", "lookup_timeout_ms", "startup_timeout_ms"]


@pytest.mark.parametrize("key", BOOL_KEYS)
@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (1, True), (0, False),
                                            ("true", True), ("False", False), ("yes", True),
                                            ("off", False), (" ON ", True), ("0", False)])
def test_bools_accepted(key, value, expected):
    assert getattr(parse({key: value}), key) is expected


@pytest.mark.parametrize("key", BOOL_KEYS)
@pytest.mark.parametrize("value", ["maybe", 2, 1.0, "", [True]])
def test_bools_rejected(key, value):
    fails({key: value}, key)


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value,expected", [(1, 1), (250, 250), ("250", 250), (100.0, 100)])
def test_ints_accepted(key, value, expected):
    assert getattr(parse({key: value}), key) == expected


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", [0, -5, "soon", 1.5, True, "", [1]])
def test_ints_rejected(key, value):
    fails({key: value}, key)


def test_key_namespace():
    assert parse({"key_namespace": "team-a/llama-3-8b"}).key_namespace == "team-a/llama-3-8b"
    for bad in ["", "   ", 5, b"ns"]:
        fails({"key_namespace": bad}, "key_namespace")


# -- engine-level checks ---------------------------------------------------------------


def test_kv_role_directions():
    assert C.transfer_directions("kv_both") == (True, True)
    assert C.transfer_directions("kv_producer") == (False, True)
    assert C.transfer_directions("kv_consumer") == (True, False)  # a consumer only loads
    for bad in ["kv_all", None, ""]:
        with pytest.raises(ValueError, match="kv_role"):
            C.transfer_directions(bad)


def test_pipeline_parallel_rejected():
    C.check_parallelism(1)
    with pytest.raises(ValueError, match="pipeline_parallel_size.*pipeline parallelism"):
        C.check_parallelism(2)


def test_prefill_context_parallel_accepted():
    """Issue #33: PCP > 1 is supported (keys carry the PCP rank, a hit needs every PCP
    rank: test_pcp.py); only pipeline parallelism is still refused."""
    for pcp in (1, 2, 4):
        C.check_parallelism(1, prefill_context_parallel_size=pcp)
    # PP is still refused with PCP.
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        C.check_parallelism(2, prefill_context_parallel_size=2)


def test_decode_context_parallel_refused():
    """DCP > 1 is refused with the key named (the connector's per-rank block size is not
    vLLM's DCP block: test_pcp.py::test_dcp_is_refused_with_the_key_named); DCP 1 passes."""
    C.check_parallelism(1, 2, decode_context_parallel_size=1)
    for dcp in (2, 4):
        with pytest.raises(ValueError, match=f"decode_context_parallel_size.*={dcp}"):
            C.check_parallelism(1, 1, decode_context_parallel_size=dcp)


def test_pcp_rank_in_socket_and_ssd_names(tmp_path):
    """Each (TP, PCP) worker has its own embedded pool socket and SSD directories; with
    PCP 1 the names are the ones they always were."""
    from umbp.vllm.endpoints import embedded_socket_path

    base = str(tmp_path / "umbp.sock")
    names = {
        embedded_socket_path(base, "eng", 0, tp, pcp_rank=pcp)
        for tp in range(2)
        for pcp in range(2)
    }
    assert len(names) == 4
    assert embedded_socket_path(base, "eng", 0, 1).endswith("-dp0-tp1.sock")
    assert embedded_socket_path(base, "eng", 0, 1, pcp_rank=1).endswith("-dp0-pcp1-tp1.sock")
    assert C.rank_tag(3) == "tp3" and C.rank_tag(3, 1) == "pcp1-tp3"
    ssd = C.SsdOptions(dirs=(str(tmp_path),), capacity_bytes=1 << 30)
    assert ssd.rank_dirs(0, 1) == [str(tmp_path / "dp0-tp1")]
    assert ssd.rank_dirs(0, 1, 1) == [str(tmp_path / "dp0-pcp1-tp1")]


def test_load_failure_policy_warning():
    assert C.load_failure_policy_warning("recompute") is None
    for policy in ("fail", None, "something-new"):
        w = C.load_failure_policy_warning(policy)
        assert w is not None and "kv_load_failure_policy" in w and "recompute" in w, w
        assert repr(policy) in w
    # A connector that never loads (kv_producer) cannot fail a load.
    assert C.load_failure_policy_warning("fail", loads=False) is None
