"""``RunaiStreamerLoader``: vLLM model loader for the ``runai_streamer`` load format.

Flow of :meth:`RunaiStreamerLoader.load_weights`:

1. choose shards like vLLM's default loader (:func:`~vllm_fastload.checkpoint.select_shards`);
   no safetensors (e.g. only ``.bin``) -> the fallback policy;
2. read and validate every shard's safetensors header (before any tensor is read: a malformed file fails
   the load before the model is touched), compute the :class:`~vllm_fastload.fingerprint.Fingerprint`;
3. check ``memory_limit`` against the largest tensor, apply runai's environment (:mod:`.runai_env`);
4. stream all shards with ``runai_model_streamer.SafetensorsStreamer`` (owned tensors, so no defensive
   clone as vLLM's built-in loader makes) into ``model.load_weights``; on CPU the tensors go straight to the
   model's ``weight_loader``;
5. check every parameter was loaded (vLLM's own ``track_weights_loading``) and emit the load report.

With ``prefetch`` steps 1-4 start in ``load_model``, before vLLM builds the model, the stream running on a thread of
its own (:mod:`.prefetch`); ``load_weights`` takes its tensors and does step 5.

Facts from vLLM (0.26-0.33 sources): ``BaseModelLoader.load_model`` calls ``load_weights(model, model_config)``
then ``process_weights_after_loading``; for object storage vLLM pulls ``*.json``/tokenizer files to a local
directory (``model_config.model``) and keeps the URI in ``model_config.model_weights``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..checkpoint import Checkpoint, ShardPlan, model_shards, read_checkpoint, shard_changed, weights_source
from ..config import StreamerConfig
from ..content import ContentPin
from ..errors import CheckpointError, ConfigError, FastloadError
from ..fallback import default_loader, fall_back, step_down
from ..fingerprint import from_vllm
from ..heap import freeze_for_load
from ..log import logger
from ..report import LoadReport
from ..storage import is_object_uri, missing_backend, scoped_environ, storage_error
from . import runai_env

try:  # vLLM is an optional dependency of the package, required to use the loader.
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
except ImportError:  # pragma: no cover - exercised only without vLLM
    BaseModelLoader = object  # type: ignore[assignment,misc]

LOAD_FORMAT = StreamerConfig.LOAD_FORMAT


def _model_device(model: Any) -> Any:
    """Device of the model's first parameter (CPU for a model without parameters)."""
    import torch

    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


@dataclass
class _Load:
    """What the steps of one ``load_weights`` / ``get_all_weights`` call share (nothing is kept on the loader
    between its steps): the shards, their validated checkpoint, the report being filled, and the read settings
    the strategy chose (``reader``: this package's page-cache reader, None = runai)."""

    plan: ShardPlan
    checkpoint: Checkpoint
    report: LoadReport
    reader: runai_env.LocalReader | None = None

    def ring(self, config: Any) -> Any:
        """The direct read's :class:`.direct.Ring` for this load under ``config`` (a StreamerConfig)."""
        from . import pagecache
        from .direct import Ring

        r = self.reader
        # the page-cache copies (opt-in) where this package reads local files itself
        return Ring(config.pinned_slot_bytes, config.pinned_slots, r.threads if r else None, config.issue_thread,
                    bool(r and r.uring), pagecache=bool(r) and pagecache.enabled())

    @property
    def headers(self) -> list:
        """The shards' headers, copies of duplicated names the index assigns elsewhere already left out."""
        return list(self.checkpoint.headers)

    @property
    def skips_copies(self) -> bool:
        """Whether some names are stored twice and the copies the index does not choose must not be read."""
        return bool(self.checkpoint.duplicates)


def _timed_edges(tensors: Iterator[tuple[str, Any]], report: LoadReport, t0: float) -> Iterator[tuple[str, Any]]:
    """``tensors``, passed through, with two marks in ``report.extra`` (seconds since ``t0``, the load's start):
    ``first_tensor_s``, when the first tensor was handed on (preparation, at TP > 1 the fan-out's agreement with the
    other ranks, with ``expected_content_digest`` on a reload the hashing of the files, then the read ring's start,
    the first tensor's reads and copies), and ``last_tensor_s``, when the last one was. What the wall holds beyond
    ``last_tensor_s`` is the tail: vLLM's work on the last tensor, closing the reader, waiting for the copies,
    freeing pinned memory (with a content pin also hashing the last tensor and checking the digest). Also
    ``other_threads``: the names of the process's other Python threads when the stream starts (they share the GIL
    with the loading thread, which takes and releases it around every copy it issues). Closing this generator
    closes ``tensors`` at once, as ``yield from`` would (the reader, the fan-out); an exception thrown in
    (``throw``, which this package does not use) reaches ``tensors`` as its close."""
    import threading

    me = threading.current_thread()
    report.extra["other_threads"] = sorted(t.name for t in threading.enumerate() if t is not me)
    first = last = None
    with contextlib.closing(tensors):
        for item in tensors:
            last = time.perf_counter()
            if first is None:
                first = last
                report.extra["first_tensor_s"] = round(first - t0, 4)
            yield item
    if last is not None:
        report.extra["last_tensor_s"] = round(last - t0, 4)


@dataclass
class _Prefetched:
    """A stream :meth:`RunaiStreamerLoader._start_prefetch` started before vLLM built the model: the running
    :class:`.prefetch.Prefetch`, the ``model_config`` it reads for, its report (filled by the stream), the
    validated checkpoint, and what :meth:`close` undoes."""

    prefetch: Any
    model_config: Any
    report: LoadReport
    checkpoint: Checkpoint
    t0: float  # time.perf_counter() when the stream was prepared (its report's marks count from it)
    environ: Any = None  # the stream's environment variables, set on vLLM's thread until close (an ExitStack)
    stream: Any = None  # CUDA: the stream that waits for each tensor's copies (the loading thread's current one)

    def close(self) -> None:
        """Stop the prefetch (:meth:`.prefetch.Prefetch.close`), then put the environment back."""
        try:
            self.prefetch.close()
        finally:
            if self.environ is not None:
                self.environ.close()

    def serves(self, model_config: Any) -> str | None:
        """Why this stream cannot serve ``load_weights(model, model_config)`` now, or None: another
        ``model_config``, or (CUDA) a current stream other than the one the copies were ordered before."""
        if self.model_config is not model_config:
            return "load_weights was called for another model_config"
        if self.stream is not None:
            import torch

            now = torch.cuda.current_stream(self.stream.device)
            if now != self.stream:
                return f"the loading thread's CUDA stream changed since load_model began ({self.stream} -> {now})"
        return None


class _Stream(NamedTuple):
    """What :meth:`RunaiStreamerLoader._tensors` prepared: the ``(name, tensor)`` iterator (nothing read before its
    first ``next``), the validated checkpoint, and the environment variables the stream sets while it runs."""

    tensors: Iterator[tuple[str, Any]]
    checkpoint: Checkpoint
    env: dict[str, str]


class RunaiStreamerLoader(BaseModelLoader):
    """Loads safetensors from local paths or ``s3://``/``gs://``/``az://`` with runai-model-streamer.

    ``load_config.model_loader_extra_config`` is validated by :class:`~vllm_fastload.config.StreamerConfig`
    in ``__init__`` (raises :class:`~vllm_fastload.errors.ConfigError`); ``__init__`` has no other effect.
    """

    def __init__(self, load_config: Any):
        self.config = StreamerConfig.from_extra(load_config.model_loader_extra_config)
        #: the report of the last finished ``load_weights`` (what loaded it: ``format_used``), None before
        self.last_report: LoadReport | None = None
        # phase seconds of the current load_model for its log line (vLLM calls create_model and load_weights)
        self._create_s: float | None = None
        self._weights_s: float | None = None
        self._arena_future: Any = None  # the read arena being page-locked while vLLM builds the model
        self._prefetched: _Prefetched | None = None  # the stream started before vLLM builds the model (prefetch)
        super().__init__(load_config)

    # -- BaseModelLoader API --------------------------------------------------------------------------
    def create_model(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``create_model``, timed (the phase log of :meth:`load_model` reports it)."""
        t = time.perf_counter()
        model = super().create_model(*args, **kwargs)
        self._create_s = time.perf_counter() - t
        return model

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``load_model``, plus one log line splitting its seconds into phases, so the time vLLM spends
        around the weights (model construction, post-processing, garbage collection) is visible. With
        ``freeze_gc`` the garbage collector's heap is frozen first (:mod:`vllm_fastload.heap`)."""
        self._create_s = self._weights_s = None
        t = time.perf_counter()
        freeze_for_load(self.config.freeze_gc)
        self._arena_future = self._start_pinning()
        try:
            self._start_pagecache(*args, **kwargs)
            self._prefetched = self._start_prefetch(*args, **kwargs)
            model = super().load_model(*args, **kwargs)
        finally:
            self._end_prefetch()  # not taken by load_weights (an error while vLLM built the model)
            self._drop_arena()  # not used by this load (a fallback, a CPU model, an error before the weights)
            from .pagecache import drop_early

            drop_early()  # not taken by the load
        total = time.perf_counter() - t
        create, weights = self._create_s, self._weights_s
        if weights is not None:
            rest = total - weights - (create or 0.0)
            logger.info(
                "fastload: load_model took %.3f s: create_model %s, load_weights %.3f s, post-processing + gc %.3f s",
                total, f"{create:.3f} s" if create is not None else "n/a", weights, rest)
        return model

    def _start_pagecache(self, vllm_config: Any = None, model_config: Any = None, *_: Any, **kwargs: Any) -> None:
        """``FASTLOAD_PAGECACHE_DMA`` (opt-in): start page-locking the local shards' page cache now, beside vLLM's
        model construction (:func:`.pagecache.start_early`), where the direct path will read them; nothing
        otherwise. Arguments: vLLM's ``load_model(vllm_config, model_config)``."""
        from . import pagecache

        model_config = kwargs.get("model_config", model_config)
        if not pagecache.enabled() or not self.config.pinned_reader or model_config is None:
            return
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        try:
            reason, _, plan = self._why_not(model_config)
        except FastloadError:
            return  # load_weights raises it
        if reason is None and not is_object_uri(weights_source(model_config)):
            pagecache.start_early(list(plan.files), torch.cuda.current_device())

    def _start_pinning(self) -> Any:
        """GPU with ``pinned_reader``: start page-locking the read ring's arena in a thread now, so it overlaps
        vLLM's model construction (``streaming.direct.ArenaFuture``). None on CPU or when off."""
        if not self.config.pinned_reader:
            return None
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        from .direct import ArenaFuture

        return ArenaFuture(self.config.pinned_slot_bytes, self.config.pinned_slots, torch.cuda.current_device())

    def _start_prefetch(self, vllm_config: Any = None, model_config: Any = None, *_: Any,
                        **kwargs: Any) -> _Prefetched | None:
        """``prefetch``: validate the checkpoint and start its stream on a thread now, before vLLM builds the
        model (:mod:`.prefetch`); None when off, when this load cannot prefetch (said at INFO with the reason) or
        when the checkpoint must fall back (``load_weights`` applies the policy). Arguments: vLLM's
        ``load_model(vllm_config, model_config)``. Raises what validating the checkpoint raises (CheckpointError,
        ConfigError), before the model is built."""
        if not self.config.prefetch:
            return None
        vllm_config = kwargs.get("vllm_config", vllm_config)
        model_config = kwargs.get("model_config", model_config)
        why, device = self._no_prefetch(vllm_config, model_config)
        if why is None:
            reason, _, plan = self._why_not(model_config)
            if reason is not None:
                return None  # load_weights falls back and says why
            t0 = time.perf_counter()
            ckpt = read_checkpoint(plan)
            sizes = [t.nbytes for h in ckpt.headers for t in h.tensors.values()]
            budget, why = self._prefetch_budget(vllm_config, device, sum(sizes), max(sizes, default=0))
        if why is not None:
            logger.info("fastload: prefetch off for this load (weights are read in load_weights): %s", why)
            return None
        from .prefetch import Prefetch

        report = LoadReport(load_format=LOAD_FORMAT, source=weights_source(model_config))
        tensors, _, env = self._tensors(plan, None, model_config, report, t0, device, ckpt)
        # the stream's variables (and the direct path's ring's, runai_env.ring_env) set here, on vLLM's thread, for
        # as long as the stream runs: the stream's own scoped_environ on the prefetch thread then finds them set and
        # changes no environment beside model construction
        environ = contextlib.ExitStack()
        environ.enter_context(scoped_environ({**env, **runai_env.ring_env(self.config.pinned_slots)}))
        setup = stream = None
        if device.type == "cuda":
            import torch

            stream = torch.cuda.current_stream(device)

            def setup() -> None:  # the consumer's device and stream: the stream waits for each tensor's copies
                torch.cuda.set_device(device)
                torch.cuda.set_stream(stream)

        try:
            prefetch = Prefetch(lambda: tensors, budget, setup)
        except BaseException:
            environ.close()
            raise
        return _Prefetched(prefetch, model_config, report, ckpt, t0, environ, stream)

    def _no_prefetch(self, vllm_config: Any, model_config: Any) -> tuple[str | None, Any]:
        """``(why this load cannot prefetch or None, the device it loads onto)``."""
        import torch

        if vllm_config is None or model_config is None:
            return "vLLM called load_model without vllm_config and model_config", None
        if self.config.hashes_content:
            return "content_hash / expected_content_digest hash on vLLM's loading thread", None
        parallel = getattr(vllm_config, "parallel_config", None)
        ranks = getattr(parallel, "world_size", 1)
        if ranks != 1:
            return f"{ranks} ranks (TP x PP) share the model: the TP fan-out is agreed in load_weights", None
        from .devmem import uses_cumem_pool

        if uses_cumem_pool(model_config):
            return "sleep mode: vLLM loads inside its memory pool", None
        load_device = (getattr(getattr(vllm_config, "load_config", None), "device", None)
                       or getattr(getattr(vllm_config, "device_config", None), "device", None))
        if load_device is None:
            return "vllm_config names no device (load_config.device, device_config.device)", None
        device = torch.device(load_device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cuda", "cpu"):
            return f"device {device} (prefetch knows CUDA and CPU)", None
        return None, device

    @staticmethod
    def _prefetch_budget(vllm_config: Any, device: Any, weights: int, largest: int) -> tuple[int, str | None]:
        """``(bytes a prefetch may hold, None)`` for a checkpoint of ``weights`` tensor bytes (the largest tensor
        ``largest``) on ``device``, or ``(0, why none)``: :func:`.prefetch.gpu_budget` on a GPU,
        :func:`.prefetch.host_budget` on CPU (within a container's memory limit)."""
        from ..config import cgroup_memory_current, cgroup_memory_max
        from .prefetch import GPU_MARGIN, gpu_budget, host_available, host_budget

        if weights <= 0:
            return 0, "the checkpoint holds no tensor bytes"
        beside = f"beside the {weights / 2**30:.2f} GiB of weights (largest tensor {largest / 2**30:.2f} GiB)"
        if device.type == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(device)
            share = getattr(getattr(vllm_config, "cache_config", None), "gpu_memory_utilization", None)
            if not isinstance(share, (int, float)):
                return 0, "vllm_config has no cache_config.gpu_memory_utilization to size the prefetch by"
            budget = gpu_budget(free, total, share, weights, largest)
            why = (f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB, gpu_memory_utilization {share}: no room "
                   f"{beside} and {GPU_MARGIN / 2**30:.0f} GiB")
        else:
            available, limit, used = host_available(), cgroup_memory_max(), cgroup_memory_current()
            budget = host_budget(available, limit, used, weights, largest)
            where = f"{available / 2**30:.1f} GiB available" + (
                f", container limit {limit / 2**30:.1f} GiB of which {(used or 0) / 2**30:.1f} GiB used"
                if limit is not None else "")
            why = f"host memory: {where}, no room {beside}"
        return (budget, None) if budget > 0 else (0, why)

    def _end_prefetch(self) -> None:
        """Stop a prefetch :meth:`load_weights` did not take (vLLM failed while building the model)."""
        pre, self._prefetched = self._prefetched, None
        if pre is not None:
            pre.close()

    def _drop_arena(self) -> None:
        """Discard the arena :meth:`_start_pinning` started, if any, and give its pinned memory back."""
        future, self._arena_future = self._arena_future, None
        if future is not None:
            from .direct import release_pinned_cache

            future.discard()
            release_pinned_cache()

    def download_model(self, model_config: Any) -> None:
        """Nothing to download: vLLM already pulled config files; weights are streamed at load time.
        Checks that the shards can be chosen (raises CheckpointError/StorageError otherwise)."""
        if not missing_backend(weights_source(model_config)):
            model_shards(model_config)

    def load_weights(self, model: Any, model_config: Any) -> None:
        """Stream the checkpoint into ``model`` (see module docstring). Raises ConfigError, CheckpointError,
        StorageError, FallbackRefused; never leaves a parameter uninitialized without an error."""
        pre, self._prefetched = self._prefetched, None
        if pre is not None:
            why = pre.serves(model_config)
            if why is None:
                self._load_prefetched(model, model_config, pre)
                return
            pre.close()
            logger.warning("fastload: the weights read beside model construction are not used, load_weights reads "
                           "them again: %s", why)
        t0 = time.perf_counter()
        report = LoadReport(load_format=LOAD_FORMAT, source=weights_source(model_config))
        pin = self._content_pin(model_config, report)
        loader, reason, plan = self._fallback_for(model_config, pin)
        if loader is not None:
            loader.load_weights(model, model_config)
            self._fell_back(report, loader, reason, t0)
            return
        tensors = self._tensors(plan, model, model_config, report, t0).tensors  # checks the files before the model
        loaded = model.load_weights(pin.stream(tensors) if pin else tensors)
        self._loaded(model, model_config, loaded, report, t0)

    def _loaded(self, model: Any, model_config: Any, loaded: Any, report: LoadReport, t0: float,
                phase_t0: float | None = None) -> None:
        """After ``model.load_weights`` returned ``loaded``: the seconds into ``report`` (:meth:`_finish`), vLLM's
        every-parameter check, then the report emitted."""
        self._finish(report, t0, phase_t0)
        t_check = time.perf_counter()
        self._check_all_loaded(model, model_config, loaded)
        report.extra["check_s"] = round(time.perf_counter() - t_check, 4)
        report.emit(self.config.report_path)
        self.last_report = report

    def _load_prefetched(self, model: Any, model_config: Any, pre: _Prefetched) -> None:
        """:meth:`load_weights` from the stream :meth:`_start_prefetch` started: the report's ``weights_phase_s``
        holds this call's seconds (which the log line leads with), its ``wall_s`` the stream's from its preparation
        (the base of ``prepare_s``, ``first_tensor_s``, ``last_tensor_s``); ``extra`` says how long the stream ran
        before this call (``prefetch_s``), the bytes of the tensors it had finished by then (``prefetched_bytes``)
        and its ``prefetch_budget_bytes``; ``consumer_wait_s`` is this thread's wait for the stream, ``read_wait_s``
        the stream's for its reader."""
        pf, report = pre.prefetch, pre.report
        t = time.perf_counter()
        try:
            loaded = model.load_weights(iter(pf))
        finally:
            pre.close()
        report.extra.update(consumer_wait_s=round(pf.wait_s, 4), prefetch_s=round(t - pre.t0, 4),
                            prefetched_bytes=pf.bytes_before_take, prefetch_budget_bytes=pf.budget_bytes)
        report.note = (f"{pf.bytes_before_take / 2**30:.2f} GiB of it read beside model construction, in the "
                       f"{t - pre.t0:.3f} s before load_weights")
        self._loaded(model, model_config, loaded, report, pre.t0, t)

    def get_all_weights(self, model_config: Any, model: Any) -> Iterator[tuple[str, Any]]:
        """Every ``(name, tensor)`` of ``model_config``'s checkpoint, through the same read paths as
        :meth:`load_weights` (pinned direct reads, the TP > 1 fan-out, CPU). vLLM's in-place ``reload_weights``
        asks a loader for this method (``vllm.model_executor.model_loader.reload.inplace``, vLLM 0.32; the name and
        signature of ``DefaultModelLoader.get_all_weights``); for a new ``weights_path`` vLLM points
        ``model_config.model`` at it first. When the checkpoint cannot be streamed the fallback policy applies and
        the fallback loader's ``get_all_weights`` yields. The load report is emitted when the iteration ends.
        With ``expected_content_digest`` the files are hashed before the first tensor is yielded (a second read),
        because a reload writes into a model that serves: a mismatch raises
        :class:`~vllm_fastload.errors.ContentMismatch` with the served weights untouched.
        The model's device is taken when this is called: vLLM moves the layers to the meta device between this call
        and the first ``next()``, and the read path (pinned direct reads, fan-out) depends on the device."""
        return self._all_weights(model_config, model, _model_device(model))

    def _all_weights(self, model_config: Any, model: Any, device: Any) -> Iterator[tuple[str, Any]]:
        t0 = time.perf_counter()
        report = LoadReport(load_format=LOAD_FORMAT, source=weights_source(model_config))
        pin = self._content_pin(model_config, report)
        loader, reason, plan = self._fallback_for(model_config, pin)
        if loader is not None:
            yield from loader.get_all_weights(model_config, model)
            self._fell_back(report, loader, reason, t0)
            return
        tensors, checkpoint, _ = self._tensors(plan, model, model_config, report, t0, device)
        if pin is not None:
            pin.precheck(checkpoint)
        yield from pin.stream(tensors) if pin else tensors
        self._finish(report, t0)
        report.emit(self.config.report_path)

    def _fallback_for(self, model_config: Any, pin: ContentPin | None) -> tuple[Any, str | None, ShardPlan | None]:
        """``(loader, reason, None)``: the loader the fallback policy picks when this checkpoint cannot be streamed
        (:meth:`_why_not` says why; ``fall_back`` raises FallbackRefused where the policy forbids it; ``pin``
        keeps hashing and checking on the fallback's stream), else ``(None, None, the shards to stream)``."""
        reason, possible, plan = self._why_not(model_config)
        if not reason:
            return None, None, plan
        return fall_back(LOAD_FORMAT, reason, self.config.fallback, self.load_config, possible=possible,
                         pin=pin), reason, None

    def _content_pin(self, model_config: Any, report: LoadReport) -> ContentPin | None:
        """What ``content_hash`` / ``expected_content_digest`` ask of this load (None: no hashing). The digest lands
        in the report and in :attr:`content_digest` (read by the preload daemon), also after a fallback."""
        self.content_digest = None
        if not self.config.hashes_content:
            return None

        def record(digest: str) -> None:
            self.content_digest = report.content_digest = digest

        return ContentPin(self.config.expected_content_digest, weights_source(model_config), record)

    def _fell_back(self, report: LoadReport, loader: Any, reason: str, t0: float) -> None:
        report.format_used, report.fallback_reason = loader.load_config.load_format, reason
        report.wall_s = time.perf_counter() - t0
        report.emit(self.config.report_path)
        self.last_report = report

    def _finish(self, report: LoadReport, t0: float, phase_t0: float | None = None) -> None:
        """Wall and consumer seconds of a finished stream (``t0``: when the stream was prepared). CPU: reader and
        consumer alternate in one thread. GPU: they overlap; the consumer's own time is what is left after waiting
        for the producer. ``phase_t0`` (``prefetch``): when ``load_weights`` began, later than ``t0``; its seconds
        become the report's ``weights_phase_s``, while ``wall_s`` spans the whole stream as ``prepare_s``,
        ``first_tensor_s`` and ``last_tensor_s`` do."""
        now = time.perf_counter()
        report.wall_s = now - t0
        self._weights_s = now - (t0 if phase_t0 is None else phase_t0)
        if phase_t0 is not None:
            report.weights_phase_s = self._weights_s
        waited = report.extra.get("consumer_wait_s", report.read_wait_s)
        report.consume_s = max(self._weights_s - waited, 0.0)

    def _tensors(self, plan: ShardPlan, model: Any, model_config: Any, report: LoadReport, t0: float,
                 device: Any = None, ckpt: Checkpoint | None = None) -> _Stream:
        """The :class:`_Stream` of ``plan`` (the shards :meth:`_why_not` chose): its tensors through the fan-out, GPU
        or CPU path (``report`` filled in), the validated checkpoint (``ckpt``: already read from ``plan``) and the
        environment the stream sets while it runs. Headers are validated, the fingerprint computed and the fan-out
        agreed on here, before the iterator is returned: a bad checkpoint fails before the model is touched."""
        source = weights_source(model_config)
        ckpt = read_checkpoint(plan) if ckpt is None else ckpt
        for warning in ckpt.warnings():
            logger.warning("fastload: %s", warning)
        load = _Load(plan, ckpt, report)
        headers = load.headers
        largest = max((h.largest for h in headers if h.largest), key=lambda t: t.nbytes, default=None)
        memory_limit = self.config.memory_limit
        device = _model_device(model) if device is None else device
        why_not_direct = self._reads_into_pinned(device, headers)
        if (largest is not None and memory_limit is not None and 0 < memory_limit < largest.nbytes
                and why_not_direct is not None):
            raise ConfigError(
                f"--model-loader-extra-config: memory_limit {memory_limit} bytes is below the largest tensor "
                f"{largest.name!r} ({largest.nbytes} bytes, {largest.nbytes / 2**20:.1f} MiB) in {source}; set "
                f"memory_limit >= {largest.nbytes}, 0 (= the largest tensor) or -1 (unlimited)."
            )
        self.config.warn_if_above_cgroup()
        env, load.reader = runai_env.load_env(self.config, plan.files, report, direct=why_not_direct is None)
        fingerprint = from_vllm(model_config, headers)
        report.fingerprint, report.shards = fingerprint.short(), len(plan.files)
        if plan.ignored:
            logger.info("fastload: %s not in %s, not loaded: %s", LOAD_FORMAT, plan.index, ", ".join(plan.ignored))
        report.extra["prepare_s"] = round(time.perf_counter() - t0, 4)  # shards, headers, fingerprint, strategy
        fan = self._fanout(device, why_not_direct, headers)
        from .devmem import outside_pools, uses_cumem_pool

        in_sleep_pool = uses_cumem_pool(model_config)

        def stream() -> Iterator[tuple[str, Any]]:
            # runai reads its settings from the environment when a stream starts: set them for this load only.
            # In sleep mode vLLM loads inside its allocator's pool, which must not keep our buffers (devmem.py).
            with scoped_environ(env), outside_pools(in_sleep_pool):
                try:
                    if fan is not None:
                        yield from self._fanned_out_tensors(load, device, fan)
                    elif device.type == "cuda":
                        yield from self._gpu_tensors(load, device, why_not_direct)
                    else:
                        yield from self._cpu_tensors(load)
                finally:
                    if fan is not None:
                        fan.close()

        return _Stream(_timed_edges(stream(), report, t0), ckpt, env)

    def _gpu_tensors(self, load: _Load, device: Any, why_not_direct: str | None) -> Iterator[tuple[str, Any]]:
        """GPU path. ``why_not_direct`` is None (:meth:`_reads_into_pinned`): tensor pieces are read straight into a
        recycled pinned arena and the GPU copies them out (``streaming.direct``; read by this package's page-cache
        reader ``load.reader``, or by runai when None); else runai reads into pageable memory and each
        tensor is copied through a pinned ring (``streaming.pipeline``), logged with the reason when
        ``pinned_reader`` asked for the former. Both: async H2D on a side stream."""
        from .direct import release_pinned_cache, stream_to_device
        from .pipeline import H2DPipeline
        from .timing import StageTimes

        cfg, report = self.config, load.report
        if why_not_direct is None:
            arena = self._take_arena(device, report)
            t, stats = StageTimes(), {}
            ring = load.ring(cfg)
            it = stream_to_device(load.headers, device, ring, t, arena, stats)
            arena = None  # the stream owns it now
            try:
                yield from self._progress(self._storage_errors(load.plan, it), load)
            finally:
                it.close()
                release_pinned_cache()
            report.extra.update(stats)
        else:
            self._drop_arena()
            if cfg.pinned_reader:
                from .direct import INTERNALS_CHANGED

                step_down("copying through the pinned ring instead of reading into pinned memory", why_not_direct,
                          broken=why_not_direct.startswith(INTERNALS_CHANGED))
            with H2DPipeline(device, pinned_slot_bytes=cfg.pinned_slot_bytes, pinned_slots=cfg.pinned_slots,
                             copy_threads=cfg.copy_threads, pipeline_thread=cfg.pipeline_thread) as pipe:
                yield from pipe.run(self._progress(self._stream(load, owned=False), load))
            t = pipe.times
            report.extra["pinned_ring_bytes"] = cfg.pinned_slot_bytes * cfg.pinned_slots
        report.extra["read_ring_pinned"] = why_not_direct is None
        t.feed(report)

    def _take_arena(self, device: Any, report: LoadReport) -> Any:
        """The pinned arena :meth:`_start_pinning` prepared for ``device`` (its seconds go to the report), or None
        (then the direct path allocates one itself)."""
        future = self._arena_future
        if future is None or future.device != device.index:
            self._drop_arena()
            return None
        self._arena_future = None
        arena, waited = future.result()
        report.extra.update(pinned_alloc_s=round(future.alloc_s, 4), pinned_alloc_wait_s=round(waited, 4))
        return arena

    def _fanout(self, device: Any, why_not_direct: str | None, headers: list) -> Any:
        """The fan-out of this load (``streaming.fanout.negotiate``, decided with the other ranks of the TP group), or
        None: then this rank reads the whole checkpoint, logged at INFO with the reason when the TP group has
        other ranks. Every rank of the TP group calls this (the config, device type and headers agree)."""
        from . import fanout

        reader_off = why_not_direct if device.type == "cuda" else None
        fan, why = fanout.negotiate(self.config.distributed, device, self.config.distributed_timeout_s, reader_off,
                               headers=headers)
        if why:
            step_down(f"{LOAD_FORMAT} reads the whole checkpoint on this rank (no fan-out)", why)
        return fan

    def _fanned_out_tensors(self, load: _Load, device: Any, fan: Any) -> Iterator[tuple[str, Any]]:
        """This rank reads its share (``streaming.direct.stream_tensors``: pinned direct reads on a GPU, by this
        package's reader ``load.reader`` or by runai when None; runai's owned slots on CPU) and gets
        the rest from the other ranks of its host (``streaming.fanout``)."""
        from .direct import release_pinned_cache, stream_tensors
        from .fanout import entries_of
        from .timing import StageTimes

        cfg, report, headers = self.config, load.report, load.headers
        entries = entries_of(headers)
        owner = fan.owners(entries)
        only = {(f, t.name) for (f, t), o in zip(entries, owner) if o == fan.me}
        arena = self._take_arena(device, report) if device.type == "cuda" else None
        t, stats = StageTimes(), {}
        # not pinned: the broadcasts run on the reading thread, and a communicator or thread NCCL starts there must
        # not take its one CPU for good
        ring = load.ring(cfg)._replace(pin=False)
        local = stream_tensors(headers, device, ring, t, arena, stats, only=only)
        arena = None  # the stream owns it now
        it = fan.run(entries, owner, self._storage_errors(load.plan, local), device)
        try:
            yield from self._progress(it, load)
        finally:
            it.close()
            release_pinned_cache()
        s = fan.stats
        t.feed(report)
        # this rank read only its share (t counts that); the model got every tensor of the checkpoint
        report.tensors, report.bytes = len(entries), sum(t.nbytes for _, t in entries)
        report.extra.update(stats, fanout=s.to_dict(), read_ring_pinned=device.type == "cuda")
        logger.info("fastload: %s fan-out over ranks %s of this host: this rank read %d tensors (%.2f GiB) and "
                    "received %d (%.2f GiB) in %d rounds (exchange %.3f s, largest round %.2f GiB)", LOAD_FORMAT,
                    list(s.ranks), s.tensors_read, s.read_bytes / 2**30, s.tensors_received,
                    s.received_bytes / 2**30, s.rounds, s.sync_s, s.peak_round_bytes / 2**30)

    def _reads_into_pinned(self, device: Any, headers: list) -> str | None:
        """None when this load takes the direct path (``streaming.direct``: GPU, ``pinned_reader``, dtypes runai
        maps), else why not."""
        if device.type != "cuda":
            return "not a GPU load"
        if not self.config.pinned_reader:
            return "pinned_reader is false"
        from .direct import unsupported

        return unsupported(headers)

    # -- helpers ----------------------------------------------------------------------------------------
    def _why_not(self, model_config: Any) -> tuple[str | None, bool, ShardPlan | None]:
        """``(reason, fallback_possible, None)`` when this loader cannot serve the model's weights; ``(None, True,
        the chosen shards)`` otherwise."""
        source = weights_source(model_config)
        remote = is_object_uri(source)
        reason = missing_backend(source)
        if reason:
            return reason, False, None
        if not remote and source.startswith(("/", "./", "../")) and not os.path.exists(source):
            # a local path that is not there (e.g. a reload_weights weights_path typo): vLLM's default loader would
            # take it for a hub repository id and try to download it
            raise CheckpointError(f"{source} does not exist: pass the model directory (the one holding config.json "
                                  f"and *.safetensors)")
        plan: ShardPlan = model_shards(model_config)
        if not plan.files:
            found = [] if remote else sorted(os.listdir(source))[:8] if os.path.isdir(source) else []
            what = f"; it holds {', '.join(found)}" if found else ""
            return f"no *.safetensors files in {source}{what}", not remote, None
        return None, True, plan

    def _stream(self, load: _Load, owned: bool = True) -> Iterator[tuple[str, Any]]:
        """``(name, host tensor)`` of every tensor of the load's headers. ``owned=False`` yields views into runai's
        reused ring: only for a consumer that copies each tensor before asking for the next (the pinned pipeline
        does). runai's ``SafetensorsStreamer`` reads whole files, so when copies of duplicated names are left out
        (``load.skips_copies``) the tensors are read by range instead (``streaming.direct.stream_tensors`` into
        owned CPU tensors, in pieces of ``pinned_slot_bytes``, at most ``pinned_slots`` of them in flight)."""
        from runai_model_streamer import SafetensorsStreamer

        plan, headers = load.plan, load.headers

        def tensors() -> Iterator[tuple[str, Any]]:
            if load.skips_copies:
                import torch

                from .direct import Ring, stream_tensors
                from .timing import StageTimes

                ring = Ring(self.config.pinned_slot_bytes, self.config.pinned_slots)
                for (_, name), t in stream_tensors(headers, torch.device("cpu"), ring, StageTimes(), pinned=False):
                    yield name, t
                return
            with SafetensorsStreamer() as streamer:
                streamer.stream_files(list(plan.files), device="cpu", owned=owned)
                yield from streamer.get_tensors()

        return self._storage_errors(plan, tensors())

    @staticmethod
    def _storage_errors(plan: ShardPlan, it: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Pass ``it`` through; for object storage, a reader failure becomes one StorageError naming the source; for
        local shards, one that changed under the reader (cut short by a copy still running, replaced) becomes a
        CheckpointError naming the shard and the first tensor past its new end (runai says only "End of file
        reached")."""
        remote = is_object_uri(plan.source)
        try:
            yield from it
        except (CheckpointError, ConfigError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001 - object-storage failures become one StorageError
            if remote:
                raise storage_error(plan.source, e) from e
            why = shard_changed(plan.files)
            if why:
                raise CheckpointError(
                    f"{why}. The shard changed while this load read it (the reader said: {type(e).__name__}: {e}): "
                    f"is a copy or download into the model folder still running? Let it finish (or restore the "
                    f"shard), then start again") from e
            raise

    def _progress(self, it: Iterator[tuple[str, Any]], load: _Load) -> Iterator[tuple[str, Any]]:
        """A progress bar over the load's tensors when vLLM's ``use_tqdm_on_load`` is on (its default)."""
        if not getattr(self.load_config, "use_tqdm_on_load", False):  # vLLM's LoadConfig field (0.26-0.33)
            return it
        from tqdm import tqdm

        return iter(tqdm(it, total=load.checkpoint.tensor_count, desc="fastload: streaming tensors", unit="tensor",
                         mininterval=1.0))

    def _cpu_tensors(self, load: _Load) -> Iterator[tuple[str, Any]]:
        """CPU path: runai's tensors straight to the model, counting tensors, bytes and the seconds spent waiting
        for the reader into the load's report."""
        from .timing import StageTimes, next_timed

        it, t = self._progress(self._stream(load), load), StageTimes()
        while True:
            item, waited = next_timed(it)
            t.read_wait_s += waited
            if item is None:
                break
            t.tensors += 1
            t.bytes += item[1].numel() * item[1].element_size()
            yield item
        t.feed(load.report)

    def _check_all_loaded(self, model: Any, model_config: Any, loaded: Any) -> None:
        """Raise when a parameter was not in the checkpoint, with vLLM's own check (as the default loader)."""
        if loaded is None or model_config.quantization is not None:
            return
        checker = default_loader(self.load_config)
        track = getattr(checker, "track_weights_loading", None)
        if track is None:
            return
        import inspect

        # vLLM 0.26: track_weights_loading(model, loaded); 0.32: (..., quantized=False)
        if "quantized" in inspect.signature(track).parameters:
            track(model, loaded, quantized=False)
        else:
            track(model, loaded)
