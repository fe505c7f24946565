"""Connector statistics (vLLM's `KVConnectorStats` protocol).

Workers and the scheduler each count what they saw since the last collection; vLLM
aggregates the per-worker objects (and the scheduler's) with `aggregate`, ships `data` to the
stats logger, which rebuilds objects through `UMBPStoreConnector.build_kv_connector_stats`
and logs `reduce()` ("KV Transfer metrics: ..."). Everything in `data` is a plain int/float so
it serializes anywhere.

The same counters reach vLLM's Prometheus endpoint (`/metrics`) through
`UMBPPromMetrics` (vLLM's `KVConnectorPromMetrics`, built by the connector's
`build_prom_metrics`): one counter per entry of `COUNTERS`, named `vllm:umbp_<name>`
(`_total` appended by the Prometheus client; transfer times in seconds), labelled like
vLLM's own metrics (model name, engine index).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

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
    "store_replica_skipped_blocks",  # replicated KV: another rank of the group stores them
    "store_bytes",
    "store_ns",
    # worker: the cancel contract (docs/protocol.md)
    "cancelled_transfers",  # past timeout_ms, cancelled: blocks given back at once
    "cancel_refused",  # a load the pool had started: its blocks were held until it finished
    "quarantined_loads",  # started sync loads past timeout_ms: failed, blocks held until the pool is done
    # scheduler: prefill/decode handoffs (request_params.py)
    "pd_handoffs_sent",  # prefill side: handoffs returned for a remote decode
    "pd_handoffs_received",  # decode side: a handoff's blocks were all in the pool
    "pd_handoff_waits",  # decode side: lookups deferred a step while the blocks were arriving
    "pd_handoff_timeouts",  # decode side: the bound passed first (the rest recomputed)
    "pd_handoff_mismatches",  # decode side: a handoff from another key namespace (ignored)
    # scheduler: KV events
    "events_suppressed",  # BlockStored events not sent: kv_event_max_objects blocks tracked
)

# Prometheus: counter name (after "vllm:umbp_") and help text per COUNTERS entry; *_ns
# counters are exported in seconds.
PROM_COUNTERS = {
    "lookups": ("lookups", "Prefix lookups in the UMBP pool's index"),
    "lookup_query_tokens": ("lookup_query_tokens", "Tokens asked about beyond the local prefix-cache hit"),
    "lookup_hit_tokens": ("lookup_hit_tokens", "Tokens the UMBP pool could supply (external prefix hits)"),
    "load_ops": ("load_ops", "Load transfers submitted to the UMBP pool"),
    "load_blocks": ("load_blocks", "KV blocks asked from the UMBP pool"),
    "load_failed_blocks": ("load_failed_blocks", "KV blocks whose load failed (recomputed)"),
    "load_bytes": ("load_bytes", "Bytes loaded from the UMBP pool"),
    "load_ns": ("load_seconds", "Summed latency of loads (submit to completion)"),
    "store_ops": ("store_ops", "Store transfers submitted to the UMBP pool"),
    "store_blocks": ("store_blocks", "KV blocks submitted for storing"),
    "store_stored_blocks": ("stored_blocks", "KV blocks newly written into the UMBP pool"),
    "store_present_blocks": ("store_present_blocks", "KV blocks already in the pool (no copy)"),
    "store_not_stored_blocks": ("store_not_stored_blocks", "KV blocks the pool refused or failed to store"),
    "store_replica_skipped_blocks": ("store_replica_skipped_blocks", "KV blocks another TP rank of the replica group stores (replicated KV stored once)"),
    "store_bytes": ("store_bytes", "Bytes stored into the UMBP pool"),
    "store_ns": ("store_seconds", "Summed latency of stores (submit to completion)"),
    "cancelled_transfers": ("cancelled_transfers", "Transfers cancelled past timeout_ms"),
    "cancel_refused": ("cancel_refused", "Cancels refused: a started load kept its blocks until done"),
    "quarantined_loads": ("quarantined_loads", "Started synchronous loads past timeout_ms, reported failed, blocks held until the pool finished or died"),
    "pd_handoffs_sent": ("pd_handoffs_sent", "Prefill/decode handoffs returned for a remote decode"),
    "pd_handoffs_received": ("pd_handoffs_received", "Prefill/decode handoffs whose blocks were all in the pool"),
    "pd_handoff_waits": ("pd_handoff_waits", "Lookups deferred a step while a handoff's blocks were arriving"),
    "pd_handoff_timeouts": ("pd_handoff_timeouts", "Handoffs whose blocks did not all arrive within their bound"),
    "pd_handoff_mismatches": ("pd_handoff_mismatches", "Handoffs from an engine of another key namespace (ignored)"),
    "events_suppressed": ("events_suppressed", "BlockStored events suppressed (kv_event_max_objects reached)"),
}
PROM_PREFIX = "vllm:umbp_"


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
            "store_replica_skipped_blocks": d.get("store_replica_skipped_blocks", 0),
            "stored_bytes": d.get("store_bytes", 0),
            "store_GBps": gbps(d.get("store_bytes", 0), d.get("store_ns", 0)),
            "cancelled_transfers": d.get("cancelled_transfers", 0),
            "cancel_refused": d.get("cancel_refused", 0),
            **{k: d.get(k, 0) for k in COUNTERS if k.startswith("pd_")},
        }

    def take(self) -> "UMBPConnectorStats | None":
        """Return a copy of the counters and reset; None when nothing happened."""
        if self.is_empty():
            return None
        out = UMBPConnectorStats(data=dict(self.data))
        self.reset()
        return out


class UMBPPromMetrics(KVConnectorPromMetrics):
    """vLLM's per-connector Prometheus hook: counters `vllm:umbp_*` fed from the stats."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for key, (name, doc) in PROM_COUNTERS.items():
            c = self._counter_cls(name=PROM_PREFIX + name, documentation=doc, labelnames=labelnames)
            self.counters[key] = {
                idx: c.labels(*vals) for idx, vals in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            v = (transfer_stats_data or {}).get(key)
            if not isinstance(v, (int, float)) or v <= 0 or engine_idx not in per_engine:
                continue
            per_engine[engine_idx].inc(v / 1e9 if key.endswith("_ns") else v)
