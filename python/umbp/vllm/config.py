"""Connector configuration: `kv_connector_extra_config` parsing and validation.

Every key of the user surface (docs/vllm.md) is parsed here, once, into a frozen
`UMBPConnectorConfig`. A bad value, an unknown key or two keys that contradict each other
raise `ValueError` naming the key; nothing is silently defaulted.

Keys (all optional):

| key | type | default | meaning |
|---|---|---|---|
| `mode` | `embedded` \\| `standalone` | `embedded` | pool inside each worker, or the node's `umbp-pool` |
| `endpoint` | socket path or `unix://` address | `$UMBP_STANDALONE_ADDRESS`, else the default socket | standalone pool to attach to; a TCP address is refused (unix sockets only) |
| `lookup_instance` | standalone: socket path or `unix://` address; embedded: a name | standalone: `endpoint`; embedded: none | standalone: pool whose index the scheduler reads; embedded (the seed's meaning): tells independent engines of one model on a host apart: mixed into each worker pool's socket name |
| `lookup_dir` | directory | the default socket's directory | embedded: where each worker's pool socket (which the scheduler's lookups attach to) is created |
| `capacity_bytes` | size | see below | embedded: DRAM per worker (per TP rank, and per PCP rank with prefill context parallelism) |
| `total_capacity_bytes` | size | | embedded: DRAM for the whole engine, split evenly over its workers (TP ranks × PCP ranks) |
| `dram_high_watermark` / `dram_low_watermark` | float in (0, 1] | the pool's (`--high-wm` / `--low-wm`) | embedded: evictor watermarks |
| `dram_use_hugepages` | bool | false | embedded: back the pool's DRAM with 2 MiB huge pages (reserved beforehand: `vm.nr_hugepages`) |
| `dram_hugepage_size` | size | 2MiB | embedded: huge page size; only 2 MiB exists in the pool (anything else is refused) |
| `dram_numa_node` | int >= 0 | none | embedded: bind the pool's DRAM to this NUMA node (mbind) |
| `dram_prefault` | bool | false | embedded: fault every DRAM page in at start |
| `num_workers` | int > 0 | the pool's default | embedded: copy threads of the worker's pool; standalone: no effect (logged), the pool's `--copy-threads` decides |
| `kv_event_max_objects` | int > 0 | 65536 | KV events: blocks tracked for BlockStored/BlockRemoved; when full, new BlockStored events are suppressed until tracked blocks leave the pool (storing and lookups go on) |
| `load_async` | bool | true | load between steps (request waits, reported via get_finished) or synchronously before the forward (ignored under kv_load_failure_policy=recompute: always async) |
| `lookup_async` | bool | false | accepted, no effect (logged once when true): lookups are shared-memory reads that never block the scheduler, so there is nothing to move off its thread |
| `enable_lookup` | bool | true | false: never report hits (store only) |
| `save_decode_cache` | bool | false | also store blocks filled by generated tokens |
| `store_replicas_once` | bool | true | standalone: KV that several TP ranks hold alike (MLA; fewer KV heads than TP ranks) is stored once, by one rank of each replica group, and loaded by all (replicas.py); false: every rank stores its own copy |
| `key_namespace` | str | derived | override the key namespace (share KV across configs you know are compatible) |
| `timeout_ms` | int > 0 | 5000 | a transfer pending longer is treated as failed by synchronous waits |
| `lookup_timeout_ms` | int > 0 | 1000 | scheduler: a pool whose heartbeat is older than this (stopped, swapped out) reads as a miss (at least 200 ms); embedded mode: also how long the first attach of a worker pool's index may wait at startup (later (re)attaches never wait) |
| `startup_timeout_ms` | int > 0 | 10000 | worker: how long connecting to the pool may take at startup |
| `pool_uid` | int >= 0 | `$UMBP_POOL_UID` | standalone: the pool's service uid; a socket served by another uid than this process's, root or this one is refused |
| `lazy_offload` | bool | false | store reusable blocks picked from vLLM's GPU free queue (next to be evicted) instead of every new block after each step (docs/vllm-hybrid.md) |
| `lazy_offload_max_blocks` | int > 0 | ceil(`max_num_batched_tokens` / block size) | lazy offload: free-queue blocks examined per scan (one after each step's frees, one per step's metadata) |
| `enable_partial_hash_hits` | bool | false | hits may end inside a block, at vLLM's `prefix_match_unit` (refused at start where vLLM or the model has no such hits) |
| `kv_layout` | `auto` \\| `engine` \\| a layout name (`BLHNC`, `BLNHC`, `LBNHC`, ...) | `auto` | KV cache layout asked of vLLM: auto asks for a block-outermost cross-layer layout where every attention backend supports it and pages are under 64 KiB (kv_layout_choice.py), engine never asks |
| `ssd_dir` | directory or list (comma-separated string) | `$UMBP_SSD_DIR` | embedded: SSD tier below DRAM, one directory per drive; each worker uses `<dir>/dp<D>-tp<T>` (`<dir>/dp<D>-pcp<P>-tp<T>` with PCP > 1; created); the directory must exist |
| `ssd_capacity` | size | `$UMBP_SSD_CAPACITY`, else half the free space / workers (TP × PCP ranks) | embedded: SSD bytes per worker |
| `ssd_high_watermark` / `ssd_low_watermark` | float in (0, 1] | `$UMBP_SSD_HIGH_WM` / `$UMBP_SSD_LOW_WM`, else the pool's (`--ssd-high-watermark` / `--ssd-low-watermark`) | embedded: SSD reclaim watermarks |
| `ssd_direct_io` | bool | `$UMBP_SSD_DIRECT_IO`, else the pool's (`--ssd-direct-io`) | embedded: O_DIRECT segment files (buffered with a warning where refused) |
| `ssd_admission` | `all` \\| `hit` \\| `never` \\| `hit-or-young[:SECONDS]` | `$UMBP_SSD_ADMISSION`, else hit-or-young | embedded: which evicted objects are written to SSD |
| `ssd_flush_on_stop` | seconds >= 0 | `$UMBP_SSD_FLUSH_ON_STOP`, else 20 | embedded: at shutdown, how long the pool may write its admitted DRAM objects to SSD so a restarted engine finds them (0: off) |

`UMBP_SSD_ENABLED=0` turns off an SSD tier that only `UMBP_SSD_DIR` asked for;
`UMBP_SSD_ENABLED=1` without a directory is an error.

Embedded capacity default: `$UMBP_DRAM_CAPACITY` (a size) per worker, else a quarter of the
machine's physical memory split over the engine's workers (TP ranks × PCP ranks). Sizes are ints (bytes) or strings
such as `64GiB`, `512MiB`, `1.5G`, `4096`; like umbp-pool, `K`, `KB` and `KiB` (and M/G/T)
are all powers of 1024.

Defaults that belong to the pool are not repeated here: they are read from the pool's
settings table (`umbp._native.pool_settings()`, the table umbp-pool's flags come from too).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from .._extra_config import checked_extra
from ._logging import get_logger

logger = get_logger("config")

MODE_EMBEDDED = "embedded"
MODE_STANDALONE = "standalone"

ENV_STANDALONE_ADDRESS = "UMBP_STANDALONE_ADDRESS"
ENV_DRAM_CAPACITY = "UMBP_DRAM_CAPACITY"

# Keys that only configure an embedded pool (the pool of the worker itself).
EMBEDDED_ONLY_KEYS = (
    "capacity_bytes",
    "total_capacity_bytes",
    "dram_high_watermark",
    "dram_low_watermark",
    "dram_use_hugepages",
    "dram_hugepage_size",
    "dram_numa_node",
    "dram_prefault",
    "lookup_dir",
)

KNOWN_KEYS = frozenset(
    {
        "mode",
        "endpoint",
        "lookup_instance",
        "load_async",
        "lookup_async",
        "enable_lookup",
        "save_decode_cache",
        "store_replicas_once",
        "key_namespace",
        "timeout_ms",
        "lookup_timeout_ms",
        "startup_timeout_ms",
        "pool_uid",
        "num_workers",
        "kv_event_max_objects",
        *EMBEDDED_ONLY_KEYS,
    }
)

HUGEPAGE_SIZE = 2 << 20  # the only huge page size the pool maps (MFD_HUGETLB | 2 MiB)
DEFAULT_KV_EVENT_MAX_OBJECTS = 65536
# Longest socket path (sun_path holds 108 bytes with the terminating NUL).
MAX_SOCKET_PATH = 107
# Longest file name embedded_socket_path() puts into lookup_dir.
EMBEDDED_SOCKET_NAME_MAX = len("umbp-emb-0123456789abcdef-dp99999-tp99999.sock")

# Same units as umbp-pool's parser (pool/src/config/): K/KB/KiB are all 1024-based.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, key: str = "size") -> int:
    """`64GiB` / `1.5GB` / `4096` / 4096 -> bytes. Raises ValueError naming `key`."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS or (not unit and "." in m.group(1)):
            raise ValueError(
                f"{key}: cannot parse size {value!r} (examples: 64GiB, 512MiB, 1.5GB, 4096)"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"{key}: expected a size, got {type(value).__name__} {value!r}")
    if n <= 0:
        raise ValueError(f"{key}: size must be positive, got {value!r}")
    return n


def parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{key}: expected a boolean, got {value!r}")


def _parse_positive(value: Any, key: str, expected: str, convert: type, high: float) -> Any:
    """`convert(value)` when that works, rounds no float and lies in (0, `high`]; otherwise a
    ValueError naming `key` and what was `expected`. A bool is never a number here."""
    if not isinstance(value, bool):
        try:
            x = convert(value)
        except (TypeError, ValueError, OverflowError):
            pass
        else:
            if 0 < x <= high and not (isinstance(value, float) and x != value):
                return x
    raise ValueError(f"{key}: expected {expected}, got {value!r}")


def parse_positive_int(value: Any, key: str) -> int:
    return _parse_positive(value, key, "a positive integer", int, float("inf"))


def parse_fraction(value: Any, key: str) -> float:
    return _parse_positive(value, key, "a fraction in (0, 1]", float, 1.0)


def parse_seconds(value: Any, key: str) -> float:
    """Seconds >= 0 (at most a day), as a number or a string; otherwise a ValueError naming `key`."""
    if not isinstance(value, bool):
        try:
            x = float(value)
        except (TypeError, ValueError, OverflowError):
            pass
        else:
            if 0 <= x <= 86400:
                return x
    raise ValueError(f"{key}: expected seconds in [0, 86400], got {value!r}")


def parse_nonnegative_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise ValueError(f"{key}: expected an integer >= 0, got {value!r}")
    return int(str(value).strip())


def parse_endpoint(value: Any, key: str) -> str:
    """A pool address -> its socket path: a path, or `unix://<path>`.

    The pool only listens on unix sockets (memory is passed as file descriptors, which TCP
    cannot carry), so `tcp://...`, any other scheme, and a bare `host:port` are refused
    with a message saying so. The parsing is the binding's `parse_endpoint`, the one
    parser umbp-pool's `--socket`, the Rust worker and scheduler and ringtool use too
    (`umbp_ipc::endpoint`), so all of them accept and refuse the same values alike.
    """
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key}: expected a socket path or unix:// address, got {value!r}")
    from .endpoints import load_native

    return load_native().parse_endpoint(key, value)


def parse_instance(value: Any, key: str) -> str:
    """Embedded `lookup_instance`: a non-empty name (no NUL) that tells engines apart."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise ValueError(f"{key}: expected a non-empty instance name, got {value!r}")
    return value.strip()


@functools.lru_cache(maxsize=1)
def _pool_settings() -> dict[str, dict[str, Any]]:
    # Loaded on first use, so importing this module needs no binding (vLLM's front end).
    from .endpoints import load_native

    return {s["name"]: s for s in load_native().pool_settings()}


def pool_default(name: str) -> str | None:
    """The pool's default of setting `name` (an `EmbeddedPool` keyword), as umbp-pool's
    flag takes it; None where the setting has none."""
    return _pool_settings()[name]["default"]


def _default_fraction(name: str) -> float:
    return parse_fraction(pool_default(name), name)


def _default_bool(name: str) -> bool:
    return parse_bool(pool_default(name), name)


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


@dataclass(frozen=True)
class UMBPConnectorConfig:
    mode: str = MODE_EMBEDDED
    endpoint: str | None = None  # standalone: resolved socket path
    lookup_instance: str | None = None  # standalone: socket the scheduler's index attaches to
    instance: str | None = None  # embedded: `lookup_instance`, mixed into the pools' socket names
    capacity_bytes: int | None = None  # embedded: per worker (resolved by capacity_per_worker)
    total_capacity_bytes: int | None = None
    dram_high_watermark: float = field(default_factory=lambda: _default_fraction("high_wm"))
    dram_low_watermark: float = field(default_factory=lambda: _default_fraction("low_wm"))
    load_async: bool = True
    lookup_async: bool = False
    enable_lookup: bool = True
    save_decode_cache: bool = False
    store_replicas_once: bool = True  # standalone: replicated KV stored once (replicas.py)
    key_namespace: str | None = None
    timeout_ms: int = 5000
    lookup_timeout_ms: int = 1000
    startup_timeout_ms: int = 10000
    pool_uid: int | None = None
    dram_use_hugepages: bool = False
    dram_hugepage_size: int = HUGEPAGE_SIZE
    dram_numa_node: int | None = None
    dram_prefault: bool = False
    lookup_dir: str | None = None  # embedded: directory of the worker pools' sockets
    num_workers: int | None = None  # embedded: the pool's copy threads (None: pool default)
    kv_event_max_objects: int = DEFAULT_KV_EVENT_MAX_OBJECTS
    ssd: "SsdOptions | None" = None  # embedded: the pool's SSD tier (ssd_* keys, UMBP_SSD_*)
    # Options accepted without effect in this configuration, each with the reason;
    # from_extra_config logs each once per process.
    notes: tuple[str, ...] = ()

    def embedded_pool_kwargs(
        self, dp_rank: int = 0, tp_rank: int = 0, tp_size: int = 1, pcp_rank: int | None = None
    ) -> dict[str, Any]:
        """Keyword arguments of `umbp._native.EmbeddedPool` that this config sets (for the
        worker of `dp_rank`/`tp_rank`, and `pcp_rank` with PCP > 1: its SSD directories are
        its own). `tp_size` is the number of workers sharing the engine's capacity (TP
        ranks × PCP ranks)."""
        kw: dict[str, Any] = {
            "high_wm": self.dram_high_watermark,
            "low_wm": self.dram_low_watermark,
        }
        if self.dram_use_hugepages:
            kw["hugepages"] = True
        if self.dram_numa_node is not None:
            kw["numa_node"] = self.dram_numa_node
        if self.dram_prefault:
            kw["prefault"] = True
        if self.num_workers is not None:
            kw["copy_threads"] = self.num_workers
        if self.ssd is not None:
            kw.update(self.ssd.pool_kwargs(dp_rank, tp_rank, tp_size, pcp_rank=pcp_rank))
        return kw

    @property
    def embedded(self) -> bool:
        return self.mode == MODE_EMBEDDED

    def capacity_per_worker(self, tp_size: int) -> int:
        """Embedded pool size for one worker (one TP rank, or one (TP, PCP) rank pair:
        `tp_size` is the engine's number of workers, TP ranks × PCP ranks)."""
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        if self.total_capacity_bytes is not None:
            return max(1, self.total_capacity_bytes // max(1, tp_size))
        env = os.environ.get(ENV_DRAM_CAPACITY)
        if env:
            return parse_size(env, ENV_DRAM_CAPACITY)
        return max(1 << 30, _physical_memory_bytes() // 4 // max(1, tp_size))

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, default_socket_path: Any = None
    ) -> "UMBPConnectorConfig":
        """Parse `kv_connector_extra_config`.

        `default_socket_path` is a zero-argument callable (the binding's
        `default_socket_path`), called only for a standalone config without `endpoint` and
        without `$UMBP_STANDALONE_ADDRESS`. Endpoints are parsed by the binding
        (`parse_endpoint`), imported only for a standalone config.
        """
        extra = checked_extra(extra, KNOWN_KEYS, "kv_connector_extra_config of UMBPStoreConnector")

        mode = extra.get("mode", MODE_EMBEDDED)
        if not isinstance(mode, str) or mode.strip().lower() not in (
            MODE_EMBEDDED,
            MODE_STANDALONE,
        ):
            raise ValueError(f"mode: expected 'embedded' or 'standalone', got {mode!r}")
        mode = mode.strip().lower()

        def has(k: str) -> bool:
            return extra.get(k) is not None

        kw: dict[str, Any] = {"mode": mode}
        notes: list[str] = []

        if mode == MODE_EMBEDDED:
            # Keys that only make sense for a pool of its own / somebody else's pool.
            if has("endpoint"):
                raise ValueError(
                    "endpoint: only valid with mode='standalone' (mode is 'embedded': each "
                    "worker runs a private pool on a derived socket)"
                )
            # The seed's embedded meaning: a name that tells independent engines of one
            # model on a host apart (their workers' sockets differ; DP ranks already do).
            if has("lookup_instance"):
                kw["instance"] = parse_instance(extra["lookup_instance"], "lookup_instance")
            if has("capacity_bytes") and has("total_capacity_bytes"):
                raise ValueError(
                    "capacity_bytes: conflicts with total_capacity_bytes (give one of them)"
                )
            if has("capacity_bytes"):
                kw["capacity_bytes"] = parse_size(extra["capacity_bytes"], "capacity_bytes")
            if has("total_capacity_bytes"):
                kw["total_capacity_bytes"] = parse_size(
                    extra["total_capacity_bytes"], "total_capacity_bytes"
                )
            hi = (
                parse_fraction(extra["dram_high_watermark"], "dram_high_watermark")
                if has("dram_high_watermark")
                else _default_fraction("high_wm")
            )
            lo = (
                parse_fraction(extra["dram_low_watermark"], "dram_low_watermark")
                if has("dram_low_watermark")
                else _default_fraction("low_wm")
            )
            if lo >= hi:
                key = "dram_low_watermark" if has("dram_low_watermark") else "dram_high_watermark"
                raise ValueError(
                    f"{key}: dram_low_watermark ({lo}) must be below dram_high_watermark ({hi})"
                )
            kw["dram_high_watermark"], kw["dram_low_watermark"] = hi, lo
            for k in ("dram_use_hugepages", "dram_prefault"):
                if has(k):
                    kw[k] = parse_bool(extra[k], k)
            if has("dram_hugepage_size"):
                hp = parse_size(extra["dram_hugepage_size"], "dram_hugepage_size")
                if hp != HUGEPAGE_SIZE:
                    raise ValueError(
                        f"dram_hugepage_size: {extra['dram_hugepage_size']!r} ({hp} bytes) is not "
                        "supported: the pool maps 2 MiB huge pages only (give 2MiB or leave it out)"
                    )
                kw["dram_hugepage_size"] = hp
                if not kw.get("dram_use_hugepages"):
                    notes.append(
                        "dram_hugepage_size has no effect without dram_use_hugepages=true "
                        "(the pool's DRAM is on normal pages)"
                    )
            if has("dram_numa_node"):
                kw["dram_numa_node"] = parse_nonnegative_int(extra["dram_numa_node"], "dram_numa_node")
            if has("lookup_dir"):
                d = extra["lookup_dir"]
                if not isinstance(d, str) or not d.strip():
                    raise ValueError(f"lookup_dir: expected a directory path, got {d!r}")
                d = os.path.abspath(os.path.expanduser(d.strip()))
                if len(d) + 1 + EMBEDDED_SOCKET_NAME_MAX > MAX_SOCKET_PATH:
                    raise ValueError(
                        f"lookup_dir: {d!r} is too long: the worker sockets' paths in it would "
                        f"exceed {MAX_SOCKET_PATH} bytes (the unix socket limit); use a directory "
                        f"path of at most {MAX_SOCKET_PATH - 1 - EMBEDDED_SOCKET_NAME_MAX} bytes"
                    )
                kw["lookup_dir"] = d
        else:
            for k in EMBEDDED_ONLY_KEYS:
                if has(k):
                    raise ValueError(
                        f"{k}: only valid with mode='embedded' (a standalone pool is sized "
                        f"by its own flags / UMBP_DRAM_* environment)"
                    )
            endpoint = extra.get("endpoint")
            if endpoint is not None:
                endpoint = parse_endpoint(endpoint, "endpoint")
            elif os.environ.get(ENV_STANDALONE_ADDRESS):
                endpoint = parse_endpoint(os.environ[ENV_STANDALONE_ADDRESS], ENV_STANDALONE_ADDRESS)
            if endpoint is None and default_socket_path is not None:
                endpoint = default_socket_path()
            kw["endpoint"] = endpoint
            li = extra.get("lookup_instance")
            if li is not None:
                li = parse_endpoint(li, "lookup_instance")
            kw["lookup_instance"] = li or endpoint

        for k in ("load_async", "lookup_async", "enable_lookup", "save_decode_cache", "store_replicas_once"):
            if has(k):
                kw[k] = parse_bool(extra[k], k)
        for k in ("timeout_ms", "lookup_timeout_ms", "startup_timeout_ms"):
            if has(k):
                kw[k] = parse_positive_int(extra[k], k)
        if has("pool_uid"):
            uid = extra["pool_uid"]
            if isinstance(uid, bool) or not isinstance(uid, (int, str)) or not str(uid).strip().isdigit():
                raise ValueError(f"pool_uid: expected a uid (an int >= 0), got {uid!r}")
            kw["pool_uid"] = int(str(uid).strip())
        if has("key_namespace"):
            ns = extra["key_namespace"]
            if not isinstance(ns, str) or not ns.strip():
                raise ValueError(f"key_namespace: expected a non-empty string, got {ns!r}")
            kw["key_namespace"] = ns
        if has("num_workers"):
            kw["num_workers"] = parse_positive_int(extra["num_workers"], "num_workers")
            if mode == MODE_STANDALONE:
                notes.append(
                    f"num_workers={kw['num_workers']} has no effect in standalone mode: the "
                    "shared pool's own copy threads move the bytes (umbp-pool --copy-threads)"
                )
        if has("kv_event_max_objects"):
            kw["kv_event_max_objects"] = parse_positive_int(
                extra["kv_event_max_objects"], "kv_event_max_objects"
            )
        if kw.get("lookup_async"):
            notes.append(
                "lookup_async=true has no effect: lookups read the pool's shared-memory index "
                "and never block the scheduler, so there is nothing to move off its thread"
            )
        if has("kv_layout"):
            # Applied by the connector's get_required_kvcache_layout, which vLLM skips when
            # VLLM_KV_CACHE_LAYOUT is set: check the value here too.
            from .kv_layout_choice import parse_kv_layout

            parse_kv_layout(extra["kv_layout"])
            if os.environ.get("VLLM_KV_CACHE_LAYOUT"):
                notes.append(
                    f"kv_layout={extra['kv_layout']!r} has no effect: VLLM_KV_CACHE_LAYOUT="
                    f"{os.environ['VLLM_KV_CACHE_LAYOUT']} decides the KV cache layout"
                )
        kw["ssd"] = SsdOptions.from_extra_config(extra, mode)
        kw["notes"] = tuple(notes)
        cfg = cls(**kw)
        log_notes_once(cfg.notes)
        return cfg


_LOGGED_NOTES: set[str] = set()


def log_notes_once(notes: tuple[str, ...] | list[str], log: logging.Logger | None = None) -> list[str]:
    """Log each note (an option accepted without effect) once per process; returns the
    notes logged now."""
    fresh = [n for n in notes if n not in _LOGGED_NOTES]
    for n in fresh:
        _LOGGED_NOTES.add(n)
        (log or logger).warning("UMBP: %s", n)
    return fresh


def prefix_caching_warning(enable_prefix_caching: Any) -> str | None:
    """The warning to log when vLLM's prefix caching is off, or None.

    Without it vLLM looks up no cached prefix at all, so every prompt is computed in full:
    the pool is still written, but a hit can only be reported to an engine that reuses
    prefixes.
    """
    if enable_prefix_caching:
        return None
    return (
        "UMBP: prefix caching is off (enable_prefix_caching=False): UMBPStoreConnector then "
        "does nothing useful (stored KV is never reused); start vLLM with "
        "--enable-prefix-caching"
    )


# kv_role -> (loads from the pool, stores into it).
_ROLE_DIRECTIONS = {
    "kv_both": (True, True),
    "kv_producer": (False, True),
    "kv_consumer": (True, False),
}


def transfer_directions(kv_role: Any) -> tuple[bool, bool]:
    """`(load, store)` for vLLM's `kv_role`: a consumer only loads, a producer only stores."""
    if kv_role not in _ROLE_DIRECTIONS:
        raise ValueError(
            f"kv_role: expected one of {', '.join(sorted(_ROLE_DIRECTIONS))}, got {kv_role!r}"
        )
    return _ROLE_DIRECTIONS[kv_role]


def rank_tag(tp_rank: int, pcp_rank: int | None = None) -> str:
    """A worker's rank in socket and directory names: `tp<T>`, or `pcp<P>-tp<T>` when a
    PCP rank is given (PCP > 1; PCP 1 keeps the names it always had)."""
    return f"tp{tp_rank}" if pcp_rank is None else f"pcp{pcp_rank}-tp{tp_rank}"


def check_parallelism(
    pipeline_parallel_size: int, prefill_context_parallel_size: int = 1, decode_context_parallel_size: int = 1
) -> None:
    """Refuse topologies the key scheme does not describe.

    Keys name (block, KV rank); with pipeline parallelism each stage holds different layers
    of the same block, which would need a stage in the key and a hit check over all stages.
    Prefill context parallelism (PCP) is accepted: the KV rank carries the PCP rank next to
    the TP rank (keys.kv_rank), and a hit needs the block from every (TP, PCP) rank, so
    whatever part of a block's KV each PCP rank holds (vLLM 0.32 replicates it without DCP,
    shards its tokens with DCP) is stored and restored by that rank under its own key.
    Decode context parallelism (DCP) > 1 is refused: vLLM's KV cache manager then counts
    a block as `block_size * DCP` tokens (`resolve_dcp_kv_block_size`) while the KV cache
    groups the connector is given carry the per-rank `block_size`, so the connector's
    block accounting (hits, offload, events) would be off by the factor DCP.
    """
    if pipeline_parallel_size > 1:
        raise ValueError(
            "pipeline_parallel_size: UMBPStoreConnector does not support pipeline parallelism "
            f"(pipeline_parallel_size={pipeline_parallel_size}); use tensor or data parallelism"
        )
    if prefill_context_parallel_size < 1:
        raise ValueError(
            f"prefill_context_parallel_size: must be at least 1, got {prefill_context_parallel_size}"
        )
    if decode_context_parallel_size > 1:
        raise ValueError(
            "decode_context_parallel_size: UMBPStoreConnector does not support decode context "
            f"parallelism (decode_context_parallel_size={decode_context_parallel_size}): vLLM's "
            f"scheduler then counts a block as block_size x {decode_context_parallel_size} tokens "
            "while each rank's cache block holds an interleaved share of them, and the "
            "connector's block accounting uses the per-rank block size; run without DCP "
            "(docs/vllm.md, Prefill context parallelism)"
        )


def load_failure_policy_warning(policy: Any, loads: bool = True) -> str | None:
    """The warning to log at start for vLLM's `kv_load_failure_policy`, or None.

    An object can be evicted between the scheduler's lookup and the worker's load; with
    "recompute" vLLM recomputes the missing blocks, with any other policy ("fail", vLLM's
    default) that request fails. Only a connector that loads can hit this.
    """
    if not loads or policy == "recompute":
        return None
    return (
        f"UMBP: kv_transfer_config kv_load_failure_policy={policy!r}: a block evicted from the "
        "pool between lookup and load then FAILS its request; set "
        "kv_load_failure_policy='recompute' to recompute such blocks instead"
    )


# ---- hybrid models and lazy offload: lazy_offload, lazy_offload_max_blocks,
# enable_partial_hash_hits (parsed apart from UMBPConnectorConfig; connector.py reads them).
OFFLOAD_KEYS = frozenset({"lazy_offload", "lazy_offload_max_blocks", "enable_partial_hash_hits"})
KNOWN_KEYS = KNOWN_KEYS | OFFLOAD_KEYS
# Used only where vLLM's scheduler config is unknown (see OffloadOptions.derive_max_blocks).
DEFAULT_LAZY_OFFLOAD_MAX_BLOCKS = 256


@dataclass(frozen=True)
class OffloadOptions:
    """`lazy_offload` (false): store reusable blocks picked from vLLM's GPU free queue (the
    next eviction candidates) instead of every newly computed block after each step;
    `lazy_offload_max_blocks` (derived, as the seed does, from `max_num_batched_tokens`:
    the blocks one step's tokens can fill, `ceil(max_num_batched_tokens / block_size)`, so
    a scan covers every block the next step's allocation can evict): free-queue blocks
    examined per scan in lazy mode; `enable_partial_hash_hits` (false): hits may end inside
    a KV block, at vLLM's `cache_config.prefix_match_unit` (needs a model and vLLM version
    that have such hits)."""

    lazy_offload: bool = False
    lazy_offload_max_blocks: int = DEFAULT_LAZY_OFFLOAD_MAX_BLOCKS
    enable_partial_hash_hits: bool = False
    # Whether lazy_offload_max_blocks was set in the config (else derive_max_blocks sets it).
    max_blocks_set: bool = False

    def derive_max_blocks(self, max_num_batched_tokens: Any, block_size: int) -> "OffloadOptions":
        """These options with `lazy_offload_max_blocks` derived from vLLM's
        `max_num_batched_tokens` (unless the config set it)."""
        if self.max_blocks_set or not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens <= 0:
            return self
        n = max(1, -(-max_num_batched_tokens // max(1, int(block_size))))
        return replace(self, lazy_offload_max_blocks=n)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "OffloadOptions":
        extra = dict(extra or {})
        kw: dict[str, Any] = {}
        for k in ("lazy_offload", "enable_partial_hash_hits"):
            if extra.get(k) is not None:
                kw[k] = parse_bool(extra[k], k)
        if extra.get("lazy_offload_max_blocks") is not None:
            kw["lazy_offload_max_blocks"] = parse_positive_int(
                extra["lazy_offload_max_blocks"], "lazy_offload_max_blocks"
            )
            kw["max_blocks_set"] = True
        return cls(**kw)


# ---- the KV cache layout asked of vLLM (kv_layout_choice.py parses and applies it).
KNOWN_KEYS = KNOWN_KEYS | {"kv_layout"}


# ---- SSD tier of the embedded pool (issue #16, docs/ssd.md): ssd_dir, ssd_capacity,
# ssd_high_watermark, ssd_low_watermark, ssd_direct_io, ssd_admission, and the seed's
# environment spellings UMBP_SSD_ENABLED / UMBP_SSD_DIR / UMBP_SSD_CAPACITY /
# UMBP_SSD_DIRECT_IO / UMBP_SSD_HIGH_WM / UMBP_SSD_LOW_WM (plus umbp-pool's
# UMBP_SSD_ADMISSION). Parsed apart from UMBPConnectorConfig's own keys; its `ssd` field
# holds the result.
SSD_KEYS = frozenset(
    {
        "ssd_dir",
        "ssd_capacity",
        "ssd_high_watermark",
        "ssd_low_watermark",
        "ssd_direct_io",
        "ssd_admission",
        "ssd_flush_on_stop",
    }
)
KNOWN_KEYS = KNOWN_KEYS | SSD_KEYS
ENV_SSD_ENABLED = "UMBP_SSD_ENABLED"
ENV_SSD_DIR = "UMBP_SSD_DIR"
ENV_SSD_CAPACITY = "UMBP_SSD_CAPACITY"
ENV_SSD_DIRECT_IO = "UMBP_SSD_DIRECT_IO"
ENV_SSD_HIGH_WM = "UMBP_SSD_HIGH_WM"
ENV_SSD_LOW_WM = "UMBP_SSD_LOW_WM"
ENV_SSD_ADMISSION = "UMBP_SSD_ADMISSION"
ENV_SSD_FLUSH_ON_STOP = "UMBP_SSD_FLUSH_ON_STOP"
# Each key's environment spelling (the extra config wins over the environment).
SSD_ENV = {
    "ssd_dir": ENV_SSD_DIR,
    "ssd_capacity": ENV_SSD_CAPACITY,
    "ssd_direct_io": ENV_SSD_DIRECT_IO,
    "ssd_high_watermark": ENV_SSD_HIGH_WM,
    "ssd_low_watermark": ENV_SSD_LOW_WM,
    "ssd_admission": ENV_SSD_ADMISSION,
    "ssd_flush_on_stop": ENV_SSD_FLUSH_ON_STOP,
}
_ADMISSION_RE = re.compile(r"^(all|hit|never|none|hit-or-young(:[0-9]+(\.[0-9]+)?)?)$")


def parse_dirs(value: Any, key: str) -> tuple[str, ...]:
    """A directory, a comma-separated list (the environment's form) or a list of them ->
    absolute paths, in order (the order must stay the same across restarts)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(d, str) for d in items):
        raise ValueError(f"{key}: expected a directory or a list of directories, got {value!r}")
    dirs = tuple(os.path.abspath(os.path.expanduser(d.strip())) for d in items if d.strip())
    if not dirs:
        raise ValueError(f"{key}: expected a directory or a list of directories, got {value!r}")
    if len(set(dirs)) != len(dirs):
        raise ValueError(f"{key}: a directory is listed twice in {value!r} (one per drive)")
    return dirs


@dataclass(frozen=True)
class SsdOptions:
    """The embedded pool's SSD tier: `dirs` (one per drive), `capacity_bytes` per worker
    (None: half the free space of the first directory's file system, split over the
    engine's workers, TP ranks × PCP ranks), watermarks, O_DIRECT, the admission policy (None: the pool's default,
    hit-or-young) and the flush at shutdown in seconds (None: the pool's default, 20 s)."""

    dirs: tuple[str, ...]
    capacity_bytes: int | None = None
    high_watermark: float = field(default_factory=lambda: _default_fraction("ssd_high_wm"))
    low_watermark: float = field(default_factory=lambda: _default_fraction("ssd_low_wm"))
    direct_io: bool = field(default_factory=lambda: _default_bool("ssd_direct_io"))
    admission: str | None = None
    flush_on_stop_s: float | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any], mode: str) -> "SsdOptions | None":
        """The SSD options of `extra` (keys) and the environment; None: no SSD tier.

        Keys are embedded-only (a standalone pool has `--ssd-dir`); in standalone mode the
        environment is the standalone pool's business and is not read here."""
        given = sorted(k for k in SSD_KEYS if extra.get(k) is not None)
        if mode != MODE_EMBEDDED:
            if given:
                raise ValueError(
                    f"{given[0]}: only valid with mode='embedded' (a standalone pool's SSD tier "
                    "is set by its own --ssd-dir / UMBP_SSD_* flags)"
                )
            return None

        def get(k: str) -> tuple[Any, str] | None:
            if extra.get(k) is not None:
                return extra[k], k
            env = SSD_ENV[k]
            v = os.environ.get(env)
            return (v, env) if v is not None and v.strip() != "" else None

        enabled_env = os.environ.get(ENV_SSD_ENABLED)
        enabled = parse_bool(enabled_env, ENV_SSD_ENABLED) if enabled_env not in (None, "") else None
        d = get("ssd_dir")
        if d is None or (enabled is False and d[1] == ENV_SSD_DIR):
            if enabled:
                raise ValueError(
                    f"{ENV_SSD_ENABLED}=1 needs a directory: set {ENV_SSD_DIR} or "
                    "kv_connector_extra_config 'ssd_dir'"
                )
            # SSD settings without a directory would silently do nothing.
            if [k for k in given if k != "ssd_dir"]:
                raise ValueError(f"{given[0]}: has no effect without ssd_dir (the SSD tier's directory)")
            return None
        kw: dict[str, Any] = {"dirs": parse_dirs(*d)}
        if (c := get("ssd_capacity")) is not None:
            kw["capacity_bytes"] = parse_size(*c)
        hi = get("ssd_high_watermark")
        lo = get("ssd_low_watermark")
        kw["high_watermark"] = parse_fraction(*hi) if hi else _default_fraction("ssd_high_wm")
        kw["low_watermark"] = parse_fraction(*lo) if lo else _default_fraction("ssd_low_wm")
        if kw["low_watermark"] > kw["high_watermark"]:
            key = (lo or hi or (None, "ssd_low_watermark"))[1]
            raise ValueError(
                f"{key}: the SSD low watermark ({kw['low_watermark']}) must not be above the "
                f"high watermark ({kw['high_watermark']})"
            )
        if (io := get("ssd_direct_io")) is not None:
            kw["direct_io"] = parse_bool(*io)
        if (a := get("ssd_admission")) is not None:
            v, key = a
            if not isinstance(v, str) or not _ADMISSION_RE.match(v.strip().lower()):
                raise ValueError(
                    f"{key}: expected all, hit, never, hit-or-young or hit-or-young:SECONDS, got {v!r}"
                )
            kw["admission"] = v.strip().lower()
        if (f := get("ssd_flush_on_stop")) is not None:
            kw["flush_on_stop_s"] = parse_seconds(*f)
        return cls(**kw)

    def rank_dirs(self, dp_rank: int, tp_rank: int, pcp_rank: int | None = None) -> list[str]:
        """One worker's directories: `<dir>/dp<D>-tp<T>` in each (`<dir>/dp<D>-pcp<P>-tp<T>`
        when a PCP rank is given, i.e. with PCP > 1; every embedded pool holds
        its directories exclusively; the names stay the same across restarts, so a restarted
        engine finds its SSD objects again). Each `dir` must exist and be writable (a typo
        is an error naming ssd_dir, never a new directory elsewhere); the per-rank
        subdirectories are created."""
        out = []
        for d in self.dirs:
            if not os.path.isdir(d):
                why = "does not exist" if not os.path.exists(d) else "is not a directory"
                raise ValueError(f"ssd_dir: {d!r} {why} (create the directory first)")
            if not os.access(d, os.W_OK | os.X_OK):
                raise ValueError(f"ssd_dir: {d!r} is not writable by this process")
            sub = os.path.join(d, f"dp{dp_rank}-{rank_tag(tp_rank, pcp_rank)}")
            try:
                os.makedirs(sub, exist_ok=True)
            except OSError as e:
                raise ValueError(f"ssd_dir: cannot create {sub!r}: {e}") from e
            out.append(sub)
        return out

    def capacity_per_worker(self, tp_size: int) -> int:
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        try:
            st = os.statvfs(self.dirs[0])
        except OSError as e:
            raise ValueError(f"ssd_dir: {self.dirs[0]!r}: {e} (give ssd_capacity)") from e
        return max(1, st.f_bavail * st.f_frsize // 2 // max(1, tp_size))

    def pool_kwargs(
        self, dp_rank: int = 0, tp_rank: int = 0, tp_size: int = 1, pcp_rank: int | None = None
    ) -> dict[str, Any]:
        """Keyword arguments of `umbp._native.EmbeddedPool` for one worker's SSD tier
        (`tp_size`: the engine's workers, TP ranks × PCP ranks)."""
        kw: dict[str, Any] = {
            "ssd_dir": self.rank_dirs(dp_rank, tp_rank, pcp_rank),
            "ssd_capacity": self.capacity_per_worker(tp_size),
            "ssd_high_wm": self.high_watermark,
            "ssd_low_wm": self.low_watermark,
            "ssd_direct_io": self.direct_io,
        }
        if self.admission is not None:
            kw["ssd_admission"] = self.admission
        if self.flush_on_stop_s is not None:
            kw["ssd_flush_on_stop"] = self.flush_on_stop_s
        return kw
