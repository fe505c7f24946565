"""Connector statistics (vLLM's `KVConnectorStats` protocol).

Workers and the scheduler each count what they saw since the last collection; vLLM
aggregates the per-worker objects (and the scheduler's) with `aggregate`, ships `data` to the
stats logger, which rebuilds objects through `UMBPStoreConnector.build_kv_connector_stats`
and logs `reduce()` ("KV Transfer metrics: ..."). Everything in `data` is a plain int/float so
it serializes anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

# Counters (summed by aggregate). *_ns are summed transfer latencies (submit -> completion).
COUNTERS = (
    # scheduler: prefix lookups
    "lookups",  # get_num_new_matched_tokens calls that consulted the index
    "lookup_query_tokens",  # tokens asked about beyond the local prefix-cache hit
    "lookup_hit_tokens",  # of those, tokens the pool can supply
    # worker: loads
    "load_ops",
    "load_blocks",
    "load_failed_blocks",
    "load_bytes",
    "load_ns",
    # worker: stores
    "store_ops",
    "store_blocks",
    "store_stored_blocks",  # newly written into the pool
    "store_present_blocks",  # already there (first writer won), no copy
    "store_not_stored_blocks",  # refused / failed / pool unreachable
    "store_bytes",
    "store_ns",
    # worker: the cancel contract (docs/protocol.md)
    "cancelled_transfers",  # past timeout_ms, cancelled: blocks given back at once
    "cancel_refused",  # a load the pool had started: its blocks were held until it finished
)


@dataclass
class UMBPConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for k in COUNTERS:
            self.data.setdefault(k, 0)

    def add(self, key: str, value: int | float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = {k: 0 for k in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS)

    def aggregate(self, other: KVConnectorStats) -> "UMBPConnectorStats":
        for k, v in (other.data or {}).items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data

        def gbps(nbytes: Any, ns: Any) -> float:
            return round(nbytes / ns, 3) if ns else 0.0  # bytes/ns == GB/s

        queried = d.get("lookup_query_tokens", 0)
        return {
            "lookups": d.get("lookups", 0),
            "hit_tokens": d.get("lookup_hit_tokens", 0),
            "miss_tokens": max(0, queried - d.get("lookup_hit_tokens", 0)),
            "hit_rate": round(d.get("lookup_hit_tokens", 0) / queried, 4) if queried else 0.0,
            "loaded_blocks": d.get("load_blocks", 0) - d.get("load_failed_blocks", 0),
            "load_failed_blocks": d.get("load_failed_blocks", 0),
            "loaded_bytes": d.get("load_bytes", 0),
            "load_GBps": gbps(d.get("load_bytes", 0), d.get("load_ns", 0)),
            "stored_blocks": d.get("store_stored_blocks", 0),
            "store_present_blocks": d.get("store_present_blocks", 0),
            "store_not_stored_blocks": d.get("store_not_stored_blocks", 0),
            "stored_bytes": d.get("store_bytes", 0),
            "store_GBps": gbps(d.get("store_bytes", 0), d.get("store_ns", 0)),
            "cancelled_transfers": d.get("cancelled_transfers", 0),
            "cancel_refused": d.get("cancel_refused", 0),
        }

    def take(self) -> "UMBPConnectorStats | None":
        """Return a copy of the counters and reset; None when nothing happened."""
        if self.is_empty():
            return None
        out = UMBPConnectorStats(data=dict(self.data))
        self.reset()
        return out
