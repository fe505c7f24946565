"""Key helpers shared by the engine integrations (`umbp.vllm`, `umbp.sglang`).

An object key is xxh3-128 over `(namespace, cache group, rank, block hash bytes)`, computed
by the binding. The namespace is the digest of a canonical JSON description of everything
that makes two engines' bytes for the same tokens identical or not. Every description
carries an `engine` tag, so that objects of different engines (whose block hashes and byte
layouts differ) can never share a key even when their hash bytes coincide.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

# Engine tags: part of every canonical namespace description.
ENGINE_SGLANG = "sglang"
ENGINE_VLLM = "vllm"


def canonical_text(desc: Mapping[str, Any]) -> str:
    """Stable JSON (sorted keys, no whitespace): the same description gives the same text
    in every process and on every host."""
    return json.dumps(dict(desc), sort_keys=True, separators=(",", ":"), default=str)


def namespace_of(native: Any, engine: str, desc: Mapping[str, Any]) -> tuple[bytes, str]:
    """(16-byte namespace, canonical text) of `desc` tagged with `engine`."""
    if not engine:
        raise ValueError("an engine tag is required for a key namespace")
    text = canonical_text({**desc, "engine": engine})
    return bytes(native.namespace_digest(text)), text


def make_keys(native: Any, namespace: bytes, group: int, rank: int, hashes: Sequence[bytes]) -> list[bytes]:
    """Object keys of `hashes` for one rank: one native call per batch, not per block."""
    batch = getattr(native, "object_keys", None)
    if batch is not None:
        return batch(namespace, group, rank, hashes if isinstance(hashes, list) else list(hashes))
    ok = native.object_key
    return [ok(namespace, group, rank, h) for h in hashes]
