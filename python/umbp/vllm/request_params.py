"""Per-request control and the prefill/decode handoff, read from a request's
`kv_transfer_params` (issue #38; docs/vllm.md "Per-request control" and "Disaggregated
prefill").

A client sets `kv_transfer_params` in the request body (OpenAI API) or in
`SamplingParams(extra_args={"kv_transfer_params": {...}})`; vLLM hands it to the connector
as `request.kv_transfer_params`. Keys this connector reads:

| key | type | meaning |
|---|---|---|
| `umbp.skip_save` (alias `lmcache.skip_save`) | bool | store nothing of this request |
| `umbp.max_store_tokens` | int >= 0 | store at most this many leading tokens (whole blocks) |
| `umbp.max_load_tokens` | int >= 0 | restore at most this many leading tokens from the pool |
| `do_remote_decode` | bool | prefill engine (P/D): this request's KV is handed to a decode engine; `request_finished` returns the handoff below |
| `do_remote_prefill` + `umbp.handoff` | bool + dict | decode engine (P/D): the handoff a prefill engine returned; the lookup waits (without blocking the scheduler) until its blocks are in the pool or its bound passes |

A bad value never fails the request: it is logged (once per key) naming the key and the
value, and that key is ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ._logging import get_logger

logger = get_logger("request_params")

SKIP_SAVE_KEYS = ("umbp.skip_save", "lmcache.skip_save")
MAX_STORE_KEY = "umbp.max_store_tokens"
MAX_LOAD_KEY = "umbp.max_load_tokens"
HANDOFF_KEY = "umbp.handoff"
HANDOFF_VERSION = 1

_warned: set[str] = set()


def _warn_once(key: str, value: Any, why: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("UMBP: kv_transfer_params %r=%r ignored: %s", key, value, why)


@dataclass(frozen=True)
class Handoff:
    """What a prefill engine tells the decode engine about a request's KV in the pool."""

    namespace: str  # hex of the prefill engine's key namespace
    blocks: int  # leading full blocks the prefill engine stored (or tried to)
    wait_ms: int  # how long the decode engine may wait for them

    def to_params(self) -> dict[str, Any]:
        return {"v": HANDOFF_VERSION, "namespace": self.namespace, "blocks": self.blocks, "wait_ms": self.wait_ms}

    @staticmethod
    def from_params(d: Any) -> "Handoff | None":
        if not isinstance(d, dict):
            _warn_once(HANDOFF_KEY, d, "expected a dict from a prefill engine's request_finished")
            return None
        try:
            if int(d.get("v", 0)) != HANDOFF_VERSION:
                _warn_once(HANDOFF_KEY, d, f"handoff version {d.get('v')!r}, this connector reads {HANDOFF_VERSION}")
                return None
            h = Handoff(str(d["namespace"]), int(d["blocks"]), int(d["wait_ms"]))
        except (KeyError, TypeError, ValueError) as e:
            _warn_once(HANDOFF_KEY, d, f"malformed ({e})")
            return None
        if h.blocks < 0 or h.wait_ms < 0:
            _warn_once(HANDOFF_KEY, d, "negative blocks or wait_ms")
            return None
        return h


@dataclass(frozen=True)
class RequestControl:
    skip_save: bool = False
    max_store_tokens: int | None = None
    max_load_tokens: int | None = None
    remote_decode: bool = False  # prefill side of a P/D handoff
    handoff: Handoff | None = None  # decode side of a P/D handoff


NO_CONTROL = RequestControl()


def _bool(params: dict, key: str) -> bool | None:
    v = params.get(key)
    if v is None:
        return None
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0"):
        return v.strip().lower() in ("true", "1")
    _warn_once(key, v, "expected a bool")
    return None


def _tokens(params: dict, key: str) -> int | None:
    v = params.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).strip().isdigit():
        _warn_once(key, v, "expected a token count (an int >= 0)")
        return None
    return int(str(v).strip())


def request_control(request: Any) -> RequestControl:
    """The control of `request` (NO_CONTROL without `kv_transfer_params`)."""
    params = getattr(request, "kv_transfer_params", None)
    if not params:
        return NO_CONTROL
    if not isinstance(params, dict):
        _warn_once("kv_transfer_params", params, "expected a dict")
        return NO_CONTROL
    skip = any(_bool(params, k) for k in SKIP_SAVE_KEYS)
    handoff = None
    if _bool(params, "do_remote_prefill") and HANDOFF_KEY in params:
        handoff = Handoff.from_params(params[HANDOFF_KEY])
    return RequestControl(
        skip_save=skip,
        max_store_tokens=_tokens(params, MAX_STORE_KEY),
        max_load_tokens=_tokens(params, MAX_LOAD_KEY),
        remote_decode=bool(_bool(params, "do_remote_decode")),
        handoff=handoff,
    )


class HandoffWait:
    """A decode request's wait for its handoff's blocks: started at its first lookup,
    over when the blocks are there or `wait_ms` passed."""

    def __init__(self, handoff: Handoff, now: float | None = None):
        self.handoff = handoff
        self.started = time.monotonic() if now is None else now

    def expired(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return (now - self.started) * 1000 >= self.handoff.wait_ms
