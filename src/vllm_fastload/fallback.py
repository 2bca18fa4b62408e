"""The one fallback policy of both load formats.

When a fast path cannot serve a load it calls :func:`fall_back` with the reason. With ``"fallback": true``
(the default) that logs a WARNING naming the reason and the load format actually used, and returns vLLM's
default loader (our extra-config keys stripped: it rejects unknown keys). With ``"fallback": false`` it raises
:class:`~vllm_fastload.errors.FallbackRefused` with the reason, so the server fails at startup instead.
Nothing falls back silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .log import logger
from .errors import CheckpointError, FallbackRefused, FastloadError


#: The load format used when falling back (vLLM's DefaultModelLoader).
FALLBACK_FORMAT = "auto"


def fall_back(load_format: str, reason: str, allow: bool, load_config: Any, *, possible: bool = True) -> Any:
    """Apply the policy and return vLLM's ``DefaultModelLoader`` for ``load_config`` (format ``auto``).

    ``allow`` is the loader's ``fallback`` setting. ``possible=False`` means the default loader cannot read this
    checkpoint either (e.g. object storage): then a :class:`FastloadError` is raised whatever ``allow`` says.
    Raises :class:`FallbackRefused` when ``allow`` is false.
    """
    if not possible:
        raise FastloadError(
            f"{load_format} cannot serve this load: {reason}. vLLM's default loader cannot read this source "
            f"either, so there is nothing to fall back to."
        )
    if not allow:
        raise FallbackRefused(
            f"{load_format} cannot serve this load: {reason}. \"fallback\": false forbids loading with vLLM's "
            f"default loader; fix the cause, or drop \"fallback\": false to load from disk with a warning."
        )
    logger.warning(
        "fastload: %s cannot serve this load: %s. Falling back to vLLM's default loader (load format %r).",
        load_format, reason, FALLBACK_FORMAT,
    )
    return default_loader(load_config)


def fall_back_on(load_format: str, error: FastloadError, allow: bool, load_config: Any) -> Any:
    """The policy for a fast path that failed with ``error``: :func:`fall_back` with the error's message as the
    reason, except for a :class:`~vllm_fastload.errors.CheckpointError`, which is raised again: the checkpoint
    itself is unusable (a malformed shard, a duplicate name without an index), vLLM's default loader would read
    the same files, and for a duplicate silently serve the last copy read. Raises :class:`FallbackRefused` when
    ``allow`` is false."""
    if isinstance(error, CheckpointError):
        raise error
    return fall_back(load_format, str(error), allow, load_config)


def default_loader(load_config: Any) -> Any:
    """vLLM's DefaultModelLoader on a copy of ``load_config`` with format ``auto`` and no extra-config keys."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    cfg = dataclasses.replace(load_config, load_format=FALLBACK_FORMAT, model_loader_extra_config={})
    return DefaultModelLoader(cfg)
