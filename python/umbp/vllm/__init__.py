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
constructed. See `config.py` for the `kv_connector_extra_config` keys, and
`connector.py` for how the modules divide the work.
"""

from .config import UMBPConnectorConfig
from .connector import UMBPStoreConnector
from .endpoints import embedded_socket_path
from .keys import make_keys
from .metadata import UMBPConnectorMetadata, UMBPWorkerMetadata
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
