"""The streaming path's switches read from the environment (``FASTLOAD_URING_*``, ``FASTLOAD_H2D_*``,
``FASTLOAD_PREFETCH_*``): opt-in read-path candidates and their sizes, set by the benchmarks that compare them
(``benchmarks/load_bench.py``'s loaders) rather than by extra-config, which holds what an operator tunes.

A value these functions cannot read is not an error (a load must not fail on a benchmark knob) but is never
silent either: a WARNING names the variable, what it holds and what it takes, and the default applies."""

from __future__ import annotations

import os
from typing import Optional

from ..log import logger


def env_int(name: str, default: int) -> int:
    """Environment variable ``name`` as a positive int (or ``default`` itself, e.g. 0 where 0 means the kernel's
    default); ``default`` when unset or empty, and (with a WARNING naming ``name``) when not a whole number > 0."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is not None and (value > 0 or value == default):
        return value
    logger.warning("fastload: %s=%r is not a whole number > 0; using the default, %d", name, raw, default)
    return default


def env_switch(name: str) -> Optional[bool]:
    """Environment variable ``name`` as a switch: True for ``1``, False for ``0``, None when unset or empty (the
    caller's default), and None with a WARNING naming ``name`` for any other value (``true``, ``yes``...: this
    project's switches take 1 or 0 only)."""
    raw = os.environ.get(name, "").strip()
    if raw in ("1", "0"):
        return raw == "1"
    if raw:
        logger.warning("fastload: %s=%r is not 1 or 0; ignored (the default applies)", name, raw)
    return None
