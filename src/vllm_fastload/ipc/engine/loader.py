"""``IpcCacheLoader``: the ``ipc_cache`` load format (engine side): its configuration, the fallback, the report.

``load_model``: the daemon socket of this rank's device -> :func:`.mapping.map_model` (fingerprint, hello and
manifest, verify, skeleton on the meta device, install, re-process, attach, release) -> done, with no disk read.
vLLM's in-place ``reload_weights`` reads the checkpoint from disk (:meth:`IpcCacheLoader.get_all_weights`,
:mod:`.reload`).
Any miss (no daemon, timeout, fingerprint mismatch, checksum or layout mismatch: a
:class:`~vllm_fastload.errors.FastloadError` raised where it was found) goes through the one fallback policy
(:func:`vllm_fastload.fallback.fall_back_on`): a WARNING naming the reason and a full load from disk through
this plugin's ``runai_streamer`` (the daemon's shard and duplicate-copy rules; vLLM's default loader only where
that cannot stream the checkpoint), or an error with ``"fallback": false``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ...config import IpcCacheConfig
from ...errors import CheckpointError, FastloadError
from ...fallback import default_loader, fall_back_on
from ...heap import freeze_for_load
from ...log import logger
from ...report import LoadReport
from ..wire.paths import SocketDirSpec
from .mapping import LOAD_FORMAT, ChecksumMismatch, engine_device, map_model
from .reload import checkpoint_loader

try:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
except ImportError:  # pragma: no cover
    BaseModelLoader = object  # type: ignore[assignment,misc]

__all__ = ["LOAD_FORMAT", "ChecksumMismatch", "IpcCacheLoader"]


def _drop_frames(error: BaseException) -> None:
    """Cut the tracebacks of ``error`` and of the exceptions it was raised from: they hold the frames of the failed
    mapping, and with them its skeleton and (copy mode) its clones of the weights, which must be freed before the
    fallback loads the weights again, and by reference counting (a frozen heap, :mod:`vllm_fastload.heap`, may not
    collect a frame-exception cycle). The message is what the fallback reports."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


class IpcCacheLoader(BaseModelLoader):
    """Maps post-processed weights from a ``vllm-fastload preload`` daemon (CPU: memfd shared memory; CUDA: one
    VMM allocation per rank, see :mod:`.transport`)."""

    def __init__(self, load_config: Any):
        self.config = IpcCacheConfig.from_extra(load_config.model_loader_extra_config)
        super().__init__(load_config)

    def download_model(self, model_config: Any) -> None:
        """Nothing to download."""

    def load_weights(self, model: Any, model_config: Any) -> None:
        """In-place (re)load of an existing model: done from disk by vLLM's default loader. Raises
        :class:`.reload.ReloadRefused` first when ``model`` serves from daemon memory that a write would change for
        every engine (``zero_copy`` on CUDA)."""
        from .mapping import zero_copy_leases
        from .reload import refuse_shared_writes

        refuse_shared_writes(model, zero_copy_leases())
        default_loader(self.load_config).load_weights(model, model_config)

    def get_all_weights(self, model_config: Any, model: Any) -> Any:
        """Every ``(name, tensor)`` of ``model_config``'s checkpoint, for vLLM's in-place ``reload_weights``
        (vLLM 0.32 ``reload.inplace``; for a new ``weights_path`` vLLM points ``model_config.model`` at it first).
        The daemon holds post-processed tensors, the reload wants the checkpoint's: they are read from disk by
        ``runai_streamer`` (:func:`.reload.checkpoint_loader`, with this config's ``fallback``, ``report_path`` and
        ``expected_content_digest``; when the checkpoint cannot be streamed its fallback policy applies). Returns
        an iterator; nothing is read until vLLM iterates it.

        Raises :class:`.reload.ReloadRefused` at once, before vLLM touches the model, when ``model`` serves from
        daemon memory that a write would change for every engine (``zero_copy`` on CUDA)."""
        from .mapping import zero_copy_leases
        from .reload import checkpoint_loader, refuse_shared_writes

        refuse_shared_writes(model, zero_copy_leases())
        return checkpoint_loader(self.load_config, self.config).get_all_weights(model_config, model)

    def get_external_weight_memory(self, vllm_config: Any) -> int:
        """vLLM >= 0.33 hook (``BaseModelLoader.get_external_weight_memory``): bytes of daemon memory this process
        serves weights from (zero_copy in device memory), so the KV cache is sized as if the weights were the
        engine's own. 0 in copy mode, on CPU, and after a fallback."""
        from .accounting import mapped_bytes

        try:
            device, transport = engine_device(vllm_config, self.load_config)
        except FastloadError:
            return 0
        return mapped_bytes(device.index) if transport.device_memory else 0

    def socket_for_this_rank(self) -> tuple[str, SocketDirSpec]:
        """The daemon socket of the device this worker uses (``socket_path`` wins over ``socket_dir``) and its
        directory with where that came from (for messages). Raises :class:`~vllm_fastload.errors.SocketDirError`
        when the socket directory cannot be used."""
        from vllm.platforms import current_platform

        from ..wire.paths import ENGINE_KEY, check_socket_dir, device_identity, socket_dir_spec, socket_path

        if self.config.socket_path:
            path = self.config.socket_path
            return path, SocketDirSpec(Path(path).parent, 'from "socket_path" in --model-loader-extra-config',
                                       ENGINE_KEY)
        local_rank = 0
        try:
            from vllm.distributed.parallel_state import get_world_group

            local_rank = get_world_group().local_rank
        except (ImportError, AssertionError, AttributeError):
            pass
        spec = socket_dir_spec(self.config.socket_dir, ENGINE_KEY)
        check_socket_dir(spec, create=False)
        # Drafts of speculative decoding have no daemon of their own yet: their socket never exists, so they fall
        # back to disk with a warning.
        role = "draft" if self.config.is_draft else "target"
        return str(socket_path(spec.path, device_identity(current_platform.device_type, local_rank), role)), spec

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
        """Map the model from the daemon, or fall back (see module docstring); with ``freeze_gc`` the garbage
        collector's heap is frozen first (:mod:`vllm_fastload.heap`). Raises
        :class:`~vllm_fastload.errors.CheckpointError` (the checkpoint itself is unusable) and
        :class:`~vllm_fastload.errors.FallbackRefused` (``"fallback": false``)."""
        t0 = time.perf_counter()
        freeze_for_load(self.config.freeze_gc)
        try:
            path, spec = self.socket_for_this_rank()
            logger.info("Loading weights via ipc_cache (mode=%s) from %s", self.config.mode, path)
            model, report = map_model(vllm_config, model_config, prefix, path, self.config, self.load_config, spec, t0)
        except FastloadError as e:
            failure = e
            if not isinstance(failure, CheckpointError):  # that one is raised again, with its traceback
                _drop_frames(failure)
        else:
            report.emit(self.config.report_path)
            return model
        # from disk through our runai_streamer: the shard selection, duplicate copies and index authority the
        # daemon's load applies (vLLM's default loader keeps the last copy of a name it reads twice); it applies
        # the content pin and, where it cannot stream the checkpoint, the same fallback policy to vLLM's loader
        streamer = checkpoint_loader(self.load_config, self.config, for_reload=False)
        loader = fall_back_on(LOAD_FORMAT, failure, self.config.fallback, self.load_config, via=streamer)
        model = loader.load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
        # the weights of a fallback come from the model's files, not from the daemon
        used = loader.last_report.format_used if loader.last_report else loader.load_config.load_format
        LoadReport(load_format=LOAD_FORMAT, source=str(model_config.model), format_used=used,
                   fallback_reason=str(failure), wall_s=time.perf_counter() - t0).emit(self.config.report_path)
        return model
