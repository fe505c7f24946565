"""Helpers shared by the engine integrations' option parsers (`umbp.vllm.config`,
`umbp.sglang.config`). Pure Python: no engine, no native code."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional


def checked_extra(extra: Optional[Mapping[str, Any]], known: Iterable[str], where: str) -> dict:
    """A copy of `extra` as a dict; a ValueError naming every unknown key (and listing the
    known ones) when it has keys outside `known`, so a typo never silently falls back to
    a default. `where` says which configuration was read (it starts the message)."""
    extra = dict(extra or {})
    known = set(known)
    unknown = sorted(set(extra) - known)
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise ValueError(f"{where}: unknown key(s) {names} (known keys: {', '.join(sorted(known))})")
    return extra
