"""KV events across the pool's tiers (issue #16): which vLLM `medium` a block is announced
with, and what the pool's tiered events mean for blocks already announced.

The pool's event log names object keys with the tier each event is about: a demotion to
SSD is ("removed", key, "dram") then ("stored", key, "ssd"), a promotion the reverse. A
block (one key per TP rank) is loadable while every rank's key is in some tier; vLLM's
events carry the slowest of them as `medium`:

| pool tier | vLLM medium | locality |
|---|---|---|
| dram | `CPU` | |
| ssd | `STORAGE` (vLLM's `MEDIUM_STORAGE`, as its own fs tier) | |
| remote | `CPU` | `REMOTE` (another node's DRAM) |

A block whose medium changes is announced again: `BlockRemoved` with the old medium, then
`BlockStored` with the new one (same hashes and tokens), so a consumer that tracks
(hash, medium) pairs stays exact.
"""

from __future__ import annotations

from typing import Any, Iterable

# Tier -> (vLLM medium, locality or None).
TIER_MEDIUM: dict[str, tuple[str, str | None]] = {
    "dram": ("CPU", None),
    "ssd": ("STORAGE", None),
    "remote": ("CPU", "REMOTE"),
}
# Slowest last: the block's medium is that of its slowest key.
_ORDER = {"dram": 0, "ssd": 1, "remote": 2}


def last_per_key(events: Iterable[Any], known: Any) -> dict[bytes, tuple[str, str]]:
    """The last (kind, tier) of each key in `known` among `events` (pairs `(kind, key)` from
    an older binding read as DRAM), in the order of those last events."""
    last: dict[bytes, tuple[str, str]] = {}
    for e in events:
        key = bytes(e[1])
        if key not in known:
            continue
        last.pop(key, None)
        last[key] = (e[0], e[2] if len(e) > 2 else "dram")
    return last


def slowest_tier(tiers: Iterable[str]) -> str:
    """The slowest of `tiers` (unknown names count as the slowest); "dram" for none."""
    out = "dram"
    for t in tiers:
        if _ORDER.get(t, 99) > _ORDER.get(out, 99):
            out = t
    return out


def medium_of(tier: str) -> tuple[str, str | None]:
    """vLLM (medium, locality) of a pool tier; an unknown tier reads as remote storage."""
    return TIER_MEDIUM.get(tier, ("STORAGE", "REMOTE"))


def restamp(ev: Any, tier: str) -> Any:
    """A copy of vLLM event `ev` (a msgspec struct) with the medium (and, where vLLM has the
    field, the locality) of `tier`."""
    import msgspec

    medium, locality = medium_of(tier)
    kw: dict[str, Any] = {"medium": medium}
    if "locality" in getattr(type(ev), "__struct_fields__", ()):
        kw["locality"] = locality
    return msgspec.structs.replace(ev, **kw)
