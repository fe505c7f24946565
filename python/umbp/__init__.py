"""UMBP: a node-local KV-cache pool for LLM serving engines.

`umbp._native` is the Rust extension (pool, worker and scheduler clients); `umbp.vllm`
is the vLLM connector (`kv_connector="UMBPStoreConnector"`; vLLM finds it through the
`vllm.general_plugins` entry point, `umbp._vllm_plugin`, or through
`kv_connector_module_path="umbp.vllm"`).

The names below come from `umbp._native`, loaded on first use (PEP 562), so that importing
the package (as vLLM's plugin loader does in every process) costs nothing more.
"""

from typing import Any

__all__ = [
    "PROTOCOL_VERSION",
    "EmbeddedPool",
    "Index",
    "UmbpError",
    "Worker",
    "default_socket_path",
    "namespace_digest",
    "object_key",
    "object_keys",
    "parse_endpoint",
    "parse_size",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        value = getattr(importlib.import_module("umbp._native"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'umbp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
