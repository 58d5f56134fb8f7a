"""Loggers that write through vLLM's handlers when the connector runs inside vLLM."""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    # vLLM configures the "vllm" logger tree only; living under it puts our lines in the
    # instance's own log with its format and level (VLLM_LOGGING_LEVEL).
    return logging.getLogger(f"vllm.pd_connector.{module.rsplit('.', 1)[-1]}")
