"""Where the pools are: the native binding and the sockets each role attaches to."""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any


def load_native() -> Any:
    # Imported lazily so that vLLM can import `umbp.vllm` (it does so in every process,
    # the front end included) where only the pure-Python part is needed.
    try:
        import umbp._native as native
    except ImportError as e:
        raise ImportError(
            "UMBPStoreConnector needs the compiled binding umbp._native "
            "(build it with `maturin develop -m python/Cargo.toml` or install the umbp wheel): "
            f"{e}"
        ) from e
    return native


def embedded_socket_path(
    default_socket_path: str,
    engine_id: str,
    dp_rank: int,
    tp_rank: int,
    lookup_dir: str | None = None,
    instance: str | None = None,
    pcp_rank: int | None = None,
) -> str:
    """Private socket of one worker's embedded pool.

    In `lookup_dir` (kv_connector_extra_config) if given, else the default socket
    directory; named after a digest of the engine id and the `lookup_instance` name if one
    is given (unix socket paths are limited to 107 bytes) plus the DP and TP rank (and the
    PCP rank when one is given, i.e. with prefill context parallelism > 1), so two
    engines or DP ranks on one host never collide, also two engines given the same
    `engine_id` but different `lookup_instance` names (the seed's meaning of that key).
    The pool itself refuses to take over a live listener. A `lookup_dir` that cannot be
    created or written is an error naming it (never a silent fallback: the scheduler and
    the workers must agree on the path).
    """
    ident = str(engine_id) if instance is None else f"{engine_id}\0lookup_instance={instance}"
    tag = hashlib.sha256(ident.encode()).hexdigest()[:16]
    rank = f"tp{tp_rank}" if pcp_rank is None else f"pcp{pcp_rank}-tp{tp_rank}"
    name = f"umbp-emb-{tag}-dp{dp_rank}-{rank}.sock"
    if lookup_dir is not None:
        try:
            os.makedirs(lookup_dir, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ValueError(f"lookup_dir: cannot create {lookup_dir!r}: {e}") from e
        if not os.path.isdir(lookup_dir) or not os.access(lookup_dir, os.W_OK | os.X_OK):
            raise ValueError(f"lookup_dir: {lookup_dir!r} is not a writable directory")
        return os.path.join(lookup_dir, name)
    d = os.path.dirname(default_socket_path) or tempfile.gettempdir()
    try:
        os.makedirs(d, exist_ok=True)
        if not os.access(d, os.W_OK | os.X_OK):
            raise PermissionError(d)
    except OSError:
        d = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(d, name)
