"""UMBP's vLLM integration: the `UMBPStoreConnector` KV connector.

    LLM(..., kv_transfer_config={
        "kv_connector": "UMBPStoreConnector",
        "kv_connector_module_path": "umbp.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"mode": "embedded", "capacity_bytes": "8GiB"},
    })

vLLM imports this module by name and takes `UMBPStoreConnector` from it. Importing needs
vLLM (and torch); the compiled binding `umbp._native` is imported only when a connector is
constructed. See `config.py` for the `kv_connector_extra_config` keys.
"""

from .config import UMBPConnectorConfig
from .connector import (
    UMBPConnectorMetadata,
    UMBPStoreConnector,
    UMBPWorkerMetadata,
    embedded_socket_path,
    make_keys,
)
from .stats import UMBPConnectorStats

__all__ = [
    "UMBPStoreConnector",
    "UMBPConnectorConfig",
    "UMBPConnectorMetadata",
    "UMBPConnectorStats",
    "UMBPWorkerMetadata",
    "embedded_socket_path",
    "make_keys",
]
