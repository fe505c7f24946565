"""UMBP: a node-local KV-cache pool for LLM serving engines.

`umbp._native` is the Rust extension (pool, worker and scheduler clients); `umbp.vllm`
is the vLLM connector (`kv_connector_module_path="umbp.vllm"`,
`kv_connector="UMBPStoreConnector"`).
"""

from umbp._native import (  # noqa: F401
    PROTOCOL_VERSION,
    EmbeddedPool,
    Index,
    UmbpError,
    Worker,
    default_socket_path,
    namespace_digest,
    object_key,
    object_keys,
    parse_size,
)

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
    "parse_size",
]
