"""UMBP's SGLang integration: a HiCache L3 storage backend over the node's UMBP pool.

    umbp-pool --socket /run/umbp/pool.sock --capacity 64GiB &
    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "umbp",
            "module_path": "umbp.sglang", "class_name": "UMBPHiCacheStorage",
            "interface_v1": 1, "endpoint": "/run/umbp/pool.sock"}'

Importing needs SGLang (and torch). See docs/sglang.md.
"""

from .config import UMBPSGLangConfig
from .storage import NAMESPACE_SCHEME, UMBPHiCacheStorage

__all__ = ["NAMESPACE_SCHEME", "UMBPHiCacheStorage", "UMBPSGLangConfig"]
