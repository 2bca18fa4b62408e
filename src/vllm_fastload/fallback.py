"""The one fallback policy of both load formats.

When a fast path cannot serve a load it calls :func:`fall_back` with the reason. With ``"fallback": true``
(the default) that logs a WARNING naming the reason and the load format actually used, and returns vLLM's
default loader (our extra-config keys stripped: it rejects unknown keys). With ``"fallback": false`` it raises
:class:`~vllm_fastload.errors.FallbackRefused` with the reason, so the server fails at startup instead.
Nothing falls back silently.

A fast path that serves the load by a slower path of its own (``runai_streamer``'s pinned ring instead of its
direct reads, per-rank reads instead of the fan-out) is no fallback to vLLM's loader, so ``fallback`` does not
forbid it; it goes through :func:`step_down`, which says so in the log with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Optional

from .log import logger

if TYPE_CHECKING:
    from .content import ContentPin
from .errors import CheckpointError, FallbackRefused, FastloadError

#: The load format used when falling back (vLLM's DefaultModelLoader).
FALLBACK_FORMAT = "auto"


def fall_back(load_format: str, reason: str, allow: bool, load_config: Any, *, possible: bool = True,
              pin: Optional[ContentPin] = None, via: Any = None) -> Any:
    """Apply the policy and return vLLM's ``DefaultModelLoader`` for ``load_config`` (format ``auto``), or ``via``.

    ``via``: a disk loader of this plugin to return instead (``ipc_cache`` passes its ``runai_streamer``, so a
    fallback picks shards and duplicate copies as the daemon would have; it applies the content pin itself, so
    ``pin`` is not used with it).
    ``allow`` is the loader's ``fallback`` setting. ``possible=False`` means the default loader cannot read this
    checkpoint either (e.g. object storage): then a :class:`FastloadError` is raised whatever ``allow`` says.
    Raises :class:`FallbackRefused` when ``allow`` is false. With ``pin`` (the loader's ``content_hash`` /
    ``expected_content_digest``, a :class:`~vllm_fastload.content.ContentPin`) the returned loader hashes what it
    reads and its load raises :class:`~vllm_fastload.errors.ContentMismatch` when the bytes differ from the pinned
    ones (:func:`vllm_fastload.content.pin_loader`).
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
    if via is not None:
        logger.warning("fastload: %s cannot serve this load: %s. Falling back to reading the checkpoint from disk "
                       "(load format %r).", load_format, reason, via.load_config.load_format)
        return via
    logger.warning(
        "fastload: %s cannot serve this load: %s. Falling back to vLLM's default loader (load format %r).",
        load_format, reason, FALLBACK_FORMAT,
    )
    loader = default_loader(load_config)
    if pin is not None:
        from .content import pin_loader

        pin_loader(loader, pin)
    return loader


def step_down(what: str, reason: str, *, broken: bool = False) -> None:
    """Log that a fast path serves this load by a slower path of its own: ``fastload: <what>: <reason>``.

    ``broken``: the faster path is off because something it relies on changed (a dependency's internals after an
    upgrade): a WARNING, since it needs fixing. Otherwise the checkpoint or the setup asks for the slower path
    (a dtype, the device, the hosts): INFO. Always allowed, whatever ``fallback`` says; raises nothing.
    """
    logger.log(logging.WARNING if broken else logging.INFO, "fastload: %s: %s", what, reason)


def fall_back_on(load_format: str, error: FastloadError, allow: bool, load_config: Any,
                 pin: Optional[ContentPin] = None, via: Any = None) -> Any:
    """The policy for a fast path that failed with ``error``: :func:`fall_back` with the error's message as the
    reason, except for a :class:`~vllm_fastload.errors.CheckpointError`, which is raised again: the checkpoint
    itself is unusable (a malformed shard, a duplicate name without an index), vLLM's default loader would read
    the same files, and for a duplicate silently serve the last copy read. Raises :class:`FallbackRefused` when
    ``allow`` is false. ``pin``, ``via``: passed on to :func:`fall_back`."""
    if isinstance(error, CheckpointError):
        raise error
    return fall_back(load_format, str(error), allow, load_config, pin=pin, via=via)


def default_loader(load_config: Any) -> Any:
    """vLLM's DefaultModelLoader on a copy of ``load_config`` with format ``auto`` and no extra-config keys."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    cfg = dataclasses.replace(load_config, load_format=FALLBACK_FORMAT, model_loader_extra_config={})
    return DefaultModelLoader(cfg)
