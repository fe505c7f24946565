"""A worker's attachment kept while its engine is idle.

The Rust worker re-attaches to a restarted pool by itself, but only when it is called: an
engine with no requests never calls it, so it found a restarted pool only at its next
request, whose stores then failed on the dead attachment (issue #33 item 8). A daemon thread
calls `Worker.maintain()` on a timer instead: it reaps completions (kept for `poll`),
notices a lost pool and re-dials a restarted one with the worker's backoff. The worker's
own lock serialises it with the engine thread's calls.
"""

from __future__ import annotations

import threading
from typing import Any

from ._logging import get_logger

logger = get_logger("worker")

#: How often an idle worker looks at its pool: a restarted pool is attached again within
#: about this long plus one handshake.
INTERVAL_S = 0.25


class KeepAttached:
    """Calls `worker.maintain()` every `interval_s` seconds on a daemon thread until `stop`."""

    def __init__(self, worker: Any, interval_s: float = INTERVAL_S):
        self._worker = worker
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="umbp-keep-attached", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._worker.maintain()
            except Exception as e:  # noqa: BLE001 - a closed worker ends the timer
                if not self._stop.is_set():
                    logger.debug("UMBP: keep-attached timer ends: %s", e)
                return

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the timer and waits for a call in progress (a re-attach) to end."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
