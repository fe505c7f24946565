"""Options of the SGLang backend, read from `--hicache-storage-backend-extra-config`.

    {"backend_name": "umbp", "module_path": "umbp.sglang", "class_name": "UMBPHiCacheStorage",
     "interface_v1": 1, "endpoint": "/run/umbp/pool.sock"}

Keys (all optional besides the three SGLang needs to load the class):
  endpoint            the pool's socket; default UMBP_STANDALONE_ADDRESS, else the binding's
                      default socket path
  timeout_ms          how long one batch waits for the pool before it is cancelled (5000)
  startup_timeout_ms  how long the first attach may wait for the pool (10000)
  pool_uid            a uid accepted as the pool's besides ours and root (UMBP_POOL_UID)
  cache_salt          a deployment salt folded into the key namespace (different salts never
                      share objects; SGLang's per-request cache_salt is in its hashes already)
  model_revision      the weights' revision, folded into the namespace
  key_namespace       replaces the whole namespace description by this string (expert use)
  staging_pages       pages of the staging buffer of the copying get/set/batch_get/batch_set
                      path (16); the `*_v1` path (interface_v1=1) needs none
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from umbp._extra_config import checked_extra

_KNOWN = {
    "backend_name", "module_path", "class_name", "interface_v1", "endpoint", "timeout_ms",
    "startup_timeout_ms", "pool_uid", "cache_salt", "model_revision", "key_namespace",
    "staging_pages",
}


@dataclass(frozen=True)
class UMBPSGLangConfig:
    endpoint: str
    timeout_ms: int = 5000
    startup_timeout_ms: int = 10000
    pool_uid: Optional[int] = None
    cache_salt: Optional[str] = None
    model_revision: Optional[str] = None
    key_namespace: Optional[str] = None
    staging_pages: int = 16

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]], default_endpoint: str) -> "UMBPSGLangConfig":
        extra = checked_extra(extra, _KNOWN, "UMBP: --hicache-storage-backend-extra-config")

        def num(key: str, default: int, minimum: int) -> int:
            v = extra.get(key, default)
            try:
                n = int(v)
            except (TypeError, ValueError):
                raise ValueError(f"UMBP: extra config '{key}' must be an integer, got {v!r}") from None
            if n < minimum:
                raise ValueError(f"UMBP: extra config '{key}' must be >= {minimum}, got {n}")
            return n

        uid = extra.get("pool_uid", os.environ.get("UMBP_POOL_UID"))
        return cls(
            endpoint=str(extra.get("endpoint") or os.environ.get("UMBP_STANDALONE_ADDRESS") or default_endpoint),
            timeout_ms=num("timeout_ms", 5000, 1),
            startup_timeout_ms=num("startup_timeout_ms", 10000, 0),
            pool_uid=None if uid in (None, "") else int(uid),
            cache_salt=None if extra.get("cache_salt") is None else str(extra["cache_salt"]),
            model_revision=None if extra.get("model_revision") is None else str(extra["model_revision"]),
            key_namespace=None if extra.get("key_namespace") is None else str(extra["key_namespace"]),
            staging_pages=num("staging_pages", 16, 1),
        )
