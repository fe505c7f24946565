"""Loggers for the connector modules."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    # Under the "vllm" logger so that the engine's handlers, format and
    # VLLM_LOGGING_LEVEL apply to our lines too.
    try:
        from vllm.logger import init_logger

        return init_logger(f"vllm.umbp.{name}")
    except Exception:  # noqa: BLE001 - vLLM missing or changed: plain logging still works
        return logging.getLogger(f"umbp.vllm.{name}")
