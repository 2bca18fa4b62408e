"""vLLM's in-place ``reload_weights`` on an engine that loaded with ``ipc_cache``.

vLLM 0.32 (``vllm.model_executor.model_loader.reload.inplace.reload_weights``) asks the engine's loader for
``get_all_weights(model_config, model)``, puts every layer back on the meta device, and per layer materializes it
on the layer's recorded ``restore_device``, loads the checkpoint's tensors with the weight loaders, post-processes,
and copies the result into the tensors the engine serves from (``param.data.copy_``, so CUDA graphs keep their
addresses). Two things differ for a mapped model:

* the skeleton was built under ``torch.device("meta")`` (:func:`.mapping._build_model`), so
  ``initialize_model``'s ``record_metadata_for_reloading`` recorded ``restore_device = meta`` for every module and
  the reload would fail with "Cannot copy out of meta tensor": :func:`record_restore_device` records the engine's
  device once the mapped tensors are installed;
* in ``zero_copy`` mode the served tensors ARE the daemon's memory. The CPU transport maps it copy-on-write
  (``MAP_PRIVATE``: the written pages become this engine's own), the CUDA transport read-write and shared
  (``shares_writes``): a reload would change the weights of every engine mapping the daemon, so
  :func:`refuse_shared_writes` refuses it before anything is touched (use ``"mode": "copy"``), and
  :func:`guard_direct_loads` makes the model's own ``load_weights`` (an RL trainer's weight sync) refuse too.

The daemon holds post-processed tensors, vLLM's reload wants the checkpoint's: :func:`checkpoint_loader` reads them
from disk with this plugin's ``runai_streamer`` loader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Optional

from ...errors import FastloadError
from ...log import logger


class ReloadRefused(FastloadError):
    """``reload_weights`` would write into memory this engine shares with the preload daemon (``zero_copy`` on a
    transport that shares writes, CUDA); the message names the socket and the fix (``"mode": "copy"``)."""


def record_restore_device(model: Any, device: Any) -> int:
    """Record ``device`` (a ``torch.device``) as the device vLLM's layerwise reload materializes every module of
    ``model`` on (``get_layerwise_info(module).restore_device``). Returns the number of modules recorded, 0 on a
    vLLM without layerwise reload (no ``vllm.model_executor.model_loader.reload.layerwise`` or no
    ``get_layerwise_info``: such a vLLM does not reload in place through this metadata, so there is nothing to
    fix). Raises nothing else."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    except ImportError:  # a vLLM without layerwise reload
        return 0
    n = 0
    for module in model.modules():
        try:
            get_layerwise_info(module).restore_device = device
        except AttributeError:  # its info has another shape: leave vLLM's record as it is
            return n
        n += 1
    return n


def _storage_range(t: Any) -> Optional[tuple[str, int, int]]:
    """``(device type, first byte address, end address)`` of ``t``'s storage; None for meta/uninitialized."""
    try:
        storage = t.untyped_storage()
        start = storage.data_ptr()
        return (t.device.type, start, start + storage.nbytes()) if start else None
    except (RuntimeError, NotImplementedError, ValueError):
        return None


def _model_tensors(model: Any) -> Iterable[Any]:
    """Every parameter and buffer of ``model`` (shared ones once)."""
    yield from model.parameters()
    yield from model.buffers()


def shared_write_segments(model: Any, leases: Iterable[Any]) -> list[str]:
    """The daemon sockets of ``leases`` (:class:`.mapping.MappedLease` of zero_copy loads) whose transport shares writes
    (:attr:`.transport.Transport.shares_writes`) and whose segment holds a tensor of ``model``: a write into one of
    ``model``'s tensors could reach that daemon. Empty when the model serves from its own memory (copy mode, a
    fallback load, a private mapping)."""
    hits = []
    ranges = [r for r in map(_storage_range, _model_tensors(model)) if r is not None]
    for lease in leases:
        if not lease.transport.shares_writes or lease.segment.buf is None:
            continue
        seg = lease.segment.buf
        kind, lo, hi = seg.device.type, seg.data_ptr(), seg.data_ptr() + lease.segment.size
        if any(k == kind and s < hi and e > lo for k, s, e in ranges):
            hits.append(lease.path)
    return hits


def _writes_reach_daemon(action: str, paths: str) -> str:
    """The part of a refusal's message that says why: ``action`` on a zero_copy engine would write into the
    daemon's memory at ``paths`` (its socket or sockets) and so change every engine mapping it."""
    return (f"{action} on an ipc_cache zero_copy engine would write into the preload daemon's memory at {paths} (this "
            f"device's transport maps it read-write and shared), changing the weights of every engine mapping that "
            f"daemon")


def refuse_shared_writes(model: Any, leases: Iterable[Any]) -> None:
    """Raise :class:`ReloadRefused` when reloading ``model`` in place would write into a daemon's memory
    (:func:`shared_write_segments` of ``leases``). Called before vLLM touches the model."""
    paths = shared_write_segments(model, leases)
    if paths:
        raise ReloadRefused(
            f"{_writes_reach_daemon('reload_weights', ', '.join(paths))}; start this engine with "
            f"--model-loader-extra-config '{{\"mode\": \"copy\"}}' to reload its own copy, or restart the daemon on "
            f"the new checkpoint")


class _RefusedLoads:
    """What :func:`guard_direct_loads` puts in place of a model's ``load_weights``: raises :class:`ReloadRefused`
    naming the daemon's socket ``path``, before it reads anything it was given. A class rather than a closure, so
    a guarded model can still be pickled and deep-copied (it holds only the path)."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ReloadRefused(
            f"{_writes_reach_daemon('model.load_weights', self.path)}; to update weights in place (an RL weight "
            f"sync), start this engine with --model-loader-extra-config '{{\"mode\": \"copy\"}}', which serves "
            f"from its own copy")


def guard_direct_loads(model: Any, lease: Any) -> bool:
    """Make ``model.load_weights`` refuse (:class:`ReloadRefused`) on a ``zero_copy`` engine whose ``lease``'s
    transport shares writes with the daemon (CUDA): a weight sync that calls the model's own ``load_weights``
    (an RL trainer through ``LLM.collective_rpc``) does not pass through :func:`refuse_shared_writes`, and its
    writes would change the daemon's memory, the weights of every engine mapping it. The instance gets a
    ``load_weights`` attribute (:class:`_RefusedLoads`) that raises before it reads ``weights``; the class's method
    stays as it is. The model is left alone on a transport that does not share writes (the CPU memfd is mapped
    copy-on-write). Returns whether the model's ``load_weights`` refuses now (also when it already did); False,
    with a WARNING, where the model does not take the attribute (a read-only ``load_weights`` property, a
    ``__setattr__`` of its own that drops it). ``lease``: a :class:`.mapping.MappedLease` (its ``path`` and
    ``transport`` are read).

    Not covered (vLLM 0.32): paths that write without the model's ``load_weights`` (``reload_weights`` with
    ``is_checkpoint_format=False``, weight-transfer engines that copy into the parameters directly), and paths
    that put the layers on the meta device first (``reload_weights`` with a weights iterator, the weight-transfer
    engines' layerwise updates): there the refusal comes after that step, so the daemon's memory is kept but this
    engine is left without weights."""
    if not lease.transport.shares_writes or not callable(getattr(model, "load_weights", None)):
        return False
    if isinstance(vars(model).get("load_weights"), _RefusedLoads):
        return True
    guard = _RefusedLoads(lease.path)
    try:
        model.load_weights = guard
    except (AttributeError, TypeError):
        pass
    if getattr(model, "load_weights", None) is not guard:
        logger.warning("fastload: could not make %s.load_weights refuse writes into the preload daemon's shared "
                       "memory (the model does not take the attribute): a weight sync through it would change the "
                       "weights of every engine mapping %s; use \"mode\": \"copy\" for engines whose weights change",
                       type(model).__name__, lease.path)
        return False
    return True


def checkpoint_loader(load_config: Any, config: Any, *, for_reload: bool = True) -> Any:
    """The ``runai_streamer`` loader (:class:`~vllm_fastload.streaming.loader.RunaiStreamerLoader`) that reads
    the checkpoint from disk for an ``ipc_cache`` engine: for a reload (``for_reload``: logs one INFO line saying
    why) and for a fallback (the same shard selection, duplicate and index rules as the daemon's load, which
    vLLM's default loader does not apply). A copy of ``load_config`` with load format ``runai_streamer`` and, of
    the ``ipc_cache`` keys (``config``, an :class:`~vllm_fastload.config.IpcCacheConfig`), only those both formats
    share (``fallback``, ``report_path``, ``expected_content_digest``; ``report_path`` not for a fallback: the
    ipc_cache loader writes that report). Raises :class:`~vllm_fastload.errors.ConfigError` only if the shared
    keys were invalid."""
    from ...config import StreamerConfig
    from ...streaming.loader import RunaiStreamerLoader

    shared = {k: getattr(config, k) for k in StreamerConfig.model_fields.keys() & type(config).model_fields.keys()}
    if for_reload:
        logger.info("fastload: ipc_cache reload_weights reads the checkpoint from disk with runai_streamer: the "
                    "preload daemon holds post-processed weights, vLLM's reload loads checkpoint-format tensors")
    else:
        shared.pop("report_path", None)
    cfg = dataclasses.replace(load_config, load_format=StreamerConfig.LOAD_FORMAT, model_loader_extra_config=shared)
    return RunaiStreamerLoader(cfg)
