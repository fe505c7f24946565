"""What the scheduler and worker halves read of their connector (`UMBPStoreConnector`
builds it in connector.py): typed here, so that neither half imports the connector, which
imports both."""

from __future__ import annotations

from typing import Any, Protocol

from .config import OffloadOptions, UMBPConnectorConfig
from .groups import GroupInfo
from .replicas import ReplicaPlan
from .stats import UMBPConnectorStats


class ConnectorView(Protocol):
    """The connector's shared state, as both halves use it (attributes of
    `UMBPStoreConnector`; vLLM's base class sets `_kv_cache_config`)."""

    _native: Any  # umbp._native
    _cfg: UMBPConnectorConfig
    _stats: UMBPConnectorStats
    _groups: list[GroupInfo]
    _group: int  # the full-attention group (or the first)
    _block_size: int
    _hash_block_size: int
    _offload: OffloadOptions
    _partial_hits: bool
    _recompute_failures: bool
    _force_async: bool
    _load_async: bool
    _tp_size: int
    _pcp_size: int  # prefill context parallel size (1 without PCP)
    _num_ranks: int  # KV ranks per engine: TP size × PCP size (keys.kv_rank_count)
    _replicas: ReplicaPlan  # which ranks share their KV bytes (replicas.py)
    _key_ranks: int  # distinct key ranks: one copy per key rank makes a hit
    _dp_rank: int
    _engine_id: str
    _do_load: bool
    _do_store: bool
    _events_enabled: bool
    _ns_text: str
    _base_namespace: bytes
    _gpu_block_pool: Any
    _kv_cache_manager: Any
    _kv_cache_config: Any
