"""vLLM plugin (entry point group `vllm.general_plugins`, name `umbp`): registers
`UMBPStoreConnector` with vLLM's `KVConnectorFactory`, so that the seed's configuration,
`"kv_connector": "UMBPStoreConnector"` without `kv_connector_module_path`, works as written.

vLLM runs every general plugin in every process it starts (front end, engine core,
workers), possibly more than once per process, so `register` must be cheap and idempotent:
it only records the module path and class name (`umbp.vllm` is imported when vLLM builds a
connector, never here) and returns quietly when the name is already registered.
`kv_connector_module_path="umbp.vllm"` keeps working independently of this plugin.
"""

from __future__ import annotations

import logging

CONNECTOR_NAME = "UMBPStoreConnector"
CONNECTOR_MODULE = "umbp.vllm"

logger = logging.getLogger("umbp.vllm.plugin")


def register() -> None:
    """Register `UMBPStoreConnector` (lazily: module path + class name). Idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR_NAME in registry:
        logger.debug("%s is already registered with vLLM", CONNECTOR_NAME)
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError as e:  # registered meanwhile (vLLM: "Connector ... is already registered.")
        if "already registered" not in str(e):
            raise
        logger.debug("%s is already registered with vLLM: %s", CONNECTOR_NAME, e)
