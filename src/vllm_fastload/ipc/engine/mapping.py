"""The engine side of an ``ipc_cache`` load, as a row of named steps (:func:`map_model`).

:func:`engine_device` (which device and transport, resolved once for the load) -> :func:`_fingerprint` (what this
engine would load) -> :func:`fetch` (connect, hello, the validated manifest; the segment mapped by that transport) ->
:func:`_verify` (each tensor's checksum sample; for a device segment in a thread beside :func:`_build_model`, the
skeleton on the meta device, else before it; always before any tensor is installed) ->
:func:`_record_restore_device` (the real device for vLLM's ``reload_weights``) -> :func:`_view_tensors` (views into
the segment, or clones in ``copy`` mode) -> :func:`_apply_entries` (install tensors, aliases and attributes) ->
:func:`_reprocess` (post-processing of the modules the daemon marked) -> attach -> :func:`_send_release` (``copy``:
the daemon may free its memory) or :func:`_keep_lease` (``zero_copy``: the connection lives as long as the process)
-> :func:`_report`.

Every step raises a :class:`~vllm_fastload.errors.CacheUnavailable` (or another
:class:`~vllm_fastload.errors.FastloadError`) when the cache cannot serve the load; the loader turns that into
the fallback policy (:mod:`vllm_fastload.fallback`). A failure after the skeleton was built removes what the
skeleton registered process-wide, so the fallback loader can build the model again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from ...config import IpcCacheConfig
from ...errors import CacheUnavailable
from ...heap import gc_paused
from ...log import logger
from ...report import LoadReport
from ..memory.backends import get_transport
from ..memory.transport import Segment, Transport
from ..wire.client import Lease, open_lease
from ..wire.messages import Manifest, Mode
from ..wire.paths import SocketDirSpec

LOAD_FORMAT = "ipc_cache"


@dataclass
class MappedLease(Lease):
    """A :class:`~vllm_fastload.ipc.wire.client.Lease` whose segment this engine mapped: ``segment`` (its flat
    ``torch.uint8`` view is ``segment.buf``) made by ``transport``. Closing the lease leaves the mapping;
    ``segment.close()`` drops it."""

    segment: Optional[Segment] = None
    transport: Optional[Transport] = None


#: Leases (connection + mapping) of zero_copy loads: they must live as long as the process serves (and tell a
#: reload whether the served memory is the daemon's, :mod:`.reload`).
_LEASES: list[MappedLease] = []


def zero_copy_leases() -> list[MappedLease]:
    """Every zero_copy lease of this process (a copy of the list)."""
    return list(_LEASES)


def fetch(path: str, fingerprint: dict, connect_timeout_s: float, state_timeout_s: float, device: Any = None,
          spec: Optional[SocketDirSpec] = None, transport: Optional[Transport] = None,
          phases: Optional[_Phases] = None) -> MappedLease:
    """The daemon's lease at ``path`` (:func:`~vllm_fastload.ipc.wire.client.open_lease`: connect, hello with
    ``fingerprint``, the validated manifest; ``spec``: the socket's directory and where it came from) with its
    segment mapped on ``device`` (a ``torch.device``; default CPU) by ``transport`` (default: the device's,
    :func:`~vllm_fastload.ipc.memory.backends.get_transport`). ``phases``: where the seconds of the two steps go
    (``lease_s``: connect, hello and the validated manifest; ``map_s``: the segment mapped), as parts of the
    caller's running phase.

    Raises what ``open_lease`` raises, :class:`~vllm_fastload.errors.ManifestError` when the segment does not fit
    the device, and :class:`.transport.NoTransport` for a device without a transport (before connecting)."""
    import torch

    device = torch.device(device or "cpu")
    transport = transport or get_transport(device)
    phases = _Phases() if phases is None else phases
    with phases.part("lease_s"):
        lease = open_lease(path, fingerprint, connect_timeout_s, state_timeout_s, spec)
    try:
        with phases.part("map_s"):
            segment = transport.open(lease.take_fd(), lease.manifest.segment, device)
    except BaseException:
        lease.close()
        raise
    return MappedLease(lease.conn, lease.manifest, lease.path, segment=segment, transport=transport)


class ChecksumMismatch(CacheUnavailable):
    """A mapped tensor's bytes differ from the manifest's checksum sample (the daemon's memory is not what it
    says); the message names the tensor."""


class SharedMemoryWrites(CacheUnavailable):
    """``zero_copy`` mode for an engine whose vLLM writes into its weights while serving (EPLB); the message names
    the setting and the fix."""


def check_mode(vllm_config: Any, mode: str) -> None:
    """Refuse ``zero_copy`` where vLLM rewrites weights in place after the load: with EPLB (``parallel_config.
    enable_eplb``, vLLM's expert-parallel load balancer) the engine moves experts between their slots while it
    serves (vLLM's ``rearrange_expert_weights_inplace``), which in ``zero_copy`` would write into the daemon's
    memory that other engines and every later start map. Raises :class:`SharedMemoryWrites` (the fallback
    policy's case; the message gives ``copy`` mode as the fix)."""
    pc = getattr(vllm_config, "parallel_config", None)
    if mode == "zero_copy" and getattr(pc, "enable_eplb", False):
        raise SharedMemoryWrites(
            "ipc_cache mode 'zero_copy' maps the preload daemon's memory, which other engines share, but this "
            "engine runs EPLB (enable_eplb), which rearranges expert weights in place while serving; set "
            "--model-loader-extra-config '{\"mode\": \"copy\"}' (the engine clones the weights and the daemon "
            "frees them)")


class _Phases(dict):
    """Seconds per phase of one load (name -> seconds, rounded to 0.1 ms), for the load report.

    :meth:`lap` closes the phase running since the previous lap; :meth:`part` times a block inside a phase, and
    with ``outside`` leaves the block out of the phase around it."""

    def __init__(self) -> None:
        super().__init__()
        self._tick = time.perf_counter()
        self._cpu0 = time.thread_time()

    def lap(self, name: str) -> None:
        """Record the seconds since the previous lap as phase ``name``."""
        now = time.perf_counter()
        self[name] = round(now - self._tick, 4)
        self._tick = now

    @contextlib.contextmanager
    def part(self, name: str, outside: bool = False) -> Iterator[None]:
        """Record the seconds of the block as ``name``; ``outside``: not part of the running lap."""
        t = time.perf_counter()
        yield
        self[name] = round(time.perf_counter() - t, 4)
        if outside:
            self._tick += self[name]

    def thread_cpu_s(self) -> float:
        """CPU seconds of this thread since the phases started."""
        return round(time.thread_time() - self._cpu0, 4)


def engine_device(vllm_config: Any, load_config: Any) -> tuple[Any, Transport]:
    """The ``torch.device`` this engine loads onto (``load_config.device`` or vLLM's device config), made
    concrete by its transport, and that transport. Raises :class:`.transport.NoTransport` for a device without
    one."""
    import torch

    device = torch.device(vllm_config.device_config.device if load_config.device is None else load_config.device)
    transport = get_transport(device)
    return transport.resolve(device), transport


def map_model(vllm_config: Any, model_config: Any, prefix: str, path: str, config: IpcCacheConfig,
              load_config: Any, spec: SocketDirSpec, t0: float) -> tuple[Any, LoadReport]:
    """Map the model from the daemon at socket ``path`` (``spec``: its directory and where that came from).

    Returns the model (in eval mode) and its load report (``wall_s`` counted from ``t0``, a ``perf_counter``).
    Raises :class:`~vllm_fastload.errors.CacheUnavailable` and its subclasses (:class:`SharedMemoryWrites`,
    :class:`ChecksumMismatch`, :class:`.client.FingerprintMismatch`, :class:`.state.InstallError`,
    :class:`~vllm_fastload.errors.ManifestError`, :class:`.transport.NoTransport`),
    :class:`~vllm_fastload.errors.CheckpointError` from the fingerprint, and the other
    :class:`~vllm_fastload.errors.FastloadError` of the socket directory and the transport."""
    check_mode(vllm_config, config.mode)
    with gc_paused():  # mapping makes objects per tensor: no collection walks the heap meanwhile
        device, transport = engine_device(vllm_config, load_config)
        phases = _Phases()
        # this package's mapping code, imported at first use (the plugin's import stays light), is imported here:
        # outside the weights phase, as a disk loader's code is imported before vLLM's "Loading weights took"
        # begins (about 10 ms on the CPU machine, in the report as imports_s)
        from ..memory import layout, state  # noqa: F401
        from ..memory.constructed import SmallOnDevice
        phases.lap("imports_s")
        plan, fp = _fingerprint(vllm_config, model_config)
        phases.lap("fingerprint_s")
        lease = fetch(path, fp.to_dict(), config.connect_timeout_s, config.state_timeout_s, device, spec, transport,
                      phases)
        phases.lap("connect_manifest_s")
        registered: list = []
        try:
            _check_content(lease, path, config.expected_content_digest)
            verifying = _Verifying(lease, path, device) if _verify_beside_build(lease.transport) else None
            if verifying is None:
                with phases.part("verify_s"):
                    _verify(lease, path)
            try:
                with phases.part("skeleton_s", outside=True):  # not part of the weights phase
                    registered = _skeleton_registrations(vllm_config)
                    small = SmallOnDevice(device)
                    model = _skeleton(vllm_config, model_config, prefix, small)
                    _check_constructed(lease, small, path)
                    # the fix of what vLLM recorded per module while building it, so the skeleton's, as that
                    # recording is part of vLLM's own model construction (outside "Loading weights took" for `auto`)
                    _record_restore_device(model, device)
            except BaseException as e:
                if verifying is not None:
                    # nothing of this load may run on behind the fallback's disk load: wait for the check. What it
                    # found comes first, as when it runs before the build (a corrupt daemon is the fallback's case
                    # whatever the build did), except after an interrupt or exit, which must not become a fallback
                    verifying.wait(raise_error=isinstance(e, Exception))
                raise
            if verifying is not None:
                with phases.part("verify_s"):  # the wait left after the build
                    verifying.wait()
                phases["verify_thread_s"] = verifying.seconds
            with phases.part("views_s"):
                tensors = _view_tensors(lease, config.mode)
            with phases.part("install_s"):
                done = _apply_entries(model, tensors, lease.manifest, small.made)
            del small
            del tensors  # copy mode: the model holds the clones; nothing else may view the mapping
            phases.lap("map_verify_install_s")
            _reprocess(model, lease.manifest, model_config, transport, device, done)
            del done
            phases.lap("reprocess_s")
            lease.attach(config.mode)
        except BaseException:
            _forget_skeleton(registered)
            lease.close()
            raise
        if config.mode == "copy":
            _send_release(lease, device)
        else:
            _keep_lease(lease, device, model)
        logger.info("Mapped %d tensors from the weight cache daemon (%s mode)", len(lease.manifest.tensors),
                    config.mode)
        phases.lap("release_s")
        return model.eval(), _report(lease.manifest, path, fp, plan, config.mode, phases, t0)


def _fingerprint(vllm_config: Any, model_config: Any) -> tuple[Any, Any]:
    """``(shard plan, fingerprint)`` of what this engine would load (the same as ``runai_streamer`` reads)."""
    from ...fingerprint import of_model

    return of_model(model_config, vllm_config)


def _check_content(lease: MappedLease, path: str, expected: Optional[str]) -> None:
    """With ``expected_content_digest`` (``expected``): the daemon must have hashed its load to that digest.
    Raises :class:`~vllm_fastload.errors.CacheUnavailable` with the reason (the fallback policy logs it)."""
    if expected is None:
        return
    got = lease.manifest.content_digest
    if got is None:
        raise CacheUnavailable(f"expected_content_digest is set but the daemon at {path} did not hash its weights: "
                               f"start `vllm-fastload preload` with --model-loader-extra-config "
                               f"'{{\"content_hash\": true}}' (or the same expected_content_digest)")
    if got != expected:
        raise CacheUnavailable(f"the daemon at {path} holds weights with content digest {got}, but "
                               f"expected_content_digest is {expected}: restart `vllm-fastload preload` on the pinned "
                               f"checkpoint, or check the pin (`vllm-fastload inspect --content-digest` of the files "
                               f"you mean to serve)")


def _verify(lease: MappedLease, path: str) -> None:
    """Check every tensor's checksum sample in the mapped segment against the manifest, before any tensor is
    installed (a corrupt daemon must not leave a half-built model behind: :func:`map_model` removes the skeleton's
    registrations when this fails). Raises :class:`ChecksumMismatch` naming the
    first tensor that differs, :class:`~vllm_fastload.errors.ManifestError` for an entry outside the segment."""
    import numpy as np

    from ..memory.layout import sample_checksums

    table = lease.manifest.tensors
    crcs = sample_checksums(lease.segment.buf, table, lease.transport)
    bad = np.flatnonzero(crcs != np.array(table.checksum, dtype=np.uint64))
    if len(bad):
        raise ChecksumMismatch(f"tensor {table.names[bad[0]]!r} in the daemon's memory does not match its checksum "
                               f"sample ({len(bad)} tensor(s) differ); the daemon at {path} serves corrupt memory: "
                               f"restart it")


def _verify_beside_build(transport: Transport) -> bool:
    """Whether :func:`_verify` runs in a thread beside the skeleton's construction (:class:`_Verifying`): for a
    device segment (CUDA VMM), where the check is a gather on the device and a copy, which wait with the GIL
    released; not for the CPU memfd, whose check is page faults and numpy under the GIL of a host with few cores,
    where the thread slowed the construction by what it saved (docs/benchmarks.md)."""
    return bool(transport.device_memory)


class _Verifying:
    """:func:`_verify` of ``lease`` in a thread of its own, started at construction; :meth:`wait` joins it and
    raises what it raised. ``seconds``: how long the check itself took (seconds, set once it ended). CUDA: the
    thread works with ``device`` current, as the load's thread does (the current device is per thread)."""

    def __init__(self, lease: MappedLease, path: str, device: Any):
        self.seconds = 0.0
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(lease, path, device), name="fastload-verify",
                                        daemon=True)
        self._thread.start()

    def _run(self, lease: MappedLease, path: str, device: Any) -> None:
        t = time.perf_counter()
        try:
            if getattr(device, "type", None) == "cuda":
                import torch

                with torch.cuda.device(device):
                    _verify(lease, path)
            else:
                _verify(lease, path)
        except BaseException as e:  # noqa: BLE001 - handed to the load's thread, which raises it
            self._error = e
        finally:
            self.seconds = round(time.perf_counter() - t, 4)

    def wait(self, raise_error: bool = True) -> None:
        """Block until the check ended; with ``raise_error``, raise what it raised (:class:`ChecksumMismatch`,
        :class:`~vllm_fastload.errors.ManifestError`)."""
        self._thread.join()
        if raise_error and self._error is not None:
            error, self._error = self._error, None
            raise error


def _build_model(vllm_config: Any, model_config: Any, prefix: str, small: Any) -> Any:
    """The engine's model built on the meta device: every module, no weight memory, except the small tensors its
    constructor makes from data, which ``small`` (a :class:`~vllm_fastload.ipc.memory.constructed.SmallOnDevice`)
    makes on the engine's device, as the daemon's were."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(model_config.dtype):
        with torch.device("meta"), small:
            return initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)


class SkeletonError(CacheUnavailable):
    """The engine's model could not be built on the meta device (the message gives vLLM's error)."""


def _skeleton(vllm_config: Any, model_config: Any, prefix: str, small: Any) -> Any:
    """:func:`_build_model`; an error of the build (not this package's) becomes a :class:`SkeletonError`, the
    fallback policy's case: a constructor that cannot run on the meta device must not stop the engine, whose disk
    load builds the model on the real device."""
    from ...errors import FastloadError

    try:
        return _build_model(vllm_config, model_config, prefix, small)
    except FastloadError:
        raise
    except Exception as e:  # noqa: BLE001 - any constructor's error; the message names it
        raise SkeletonError(f"this engine could not build the model on the meta device to map the cache into "
                            f"({type(e).__name__}: {e}); the model's constructor needs real tensors") from e


def _check_constructed(lease: MappedLease, small: Any, path: str) -> None:
    """The small tensors this engine's constructor made must be the daemon's (their digest); raises
    :class:`~vllm_fastload.ipc.memory.constructed.ConstructionMismatch`. The skeleton keeps them, so the daemon
    exported only those that changed since (:mod:`~vllm_fastload.ipc.memory.constructed`)."""
    from ..memory.constructed import check

    check(lease.manifest.constructed.digest, small.digest(), path)


def _view_tensors(lease: MappedLease, mode: Mode) -> dict[str, tuple[str, Any]]:
    """name -> ``(kind, tensor)``: views into the segment (``zero_copy``) or clones of them (``copy``); a ``host_``
    kind's tensor as a copy on the host under its plain kind (:func:`~vllm_fastload.ipc.memory.layout.to_host`). Raises
    :class:`~vllm_fastload.errors.ManifestError` naming an entry that does not fit the segment."""
    from ..memory.layout import to_host, views
    from ..wire.messages import FIRST_HOST_KIND, KINDS

    table = lease.manifest.tensors
    host = [i for i, k in enumerate(table.kind) if k >= FIRST_HOST_KIND]
    mapped = views(lease.segment.buf, table, host_rows=not host).values()  # in row order
    kinds = [KINDS[k] for k in table.kind]
    if host:  # tensors the daemon's model keeps on the host: copied there, in their kind without the prefix
        mapped = list(mapped)
        for i, t in zip(host, to_host(lease.segment.buf, table, host)):
            mapped[i] = t
            kinds[i] = kinds[i].removeprefix("host_")
    if mode == "copy":
        on_host = set(host)
        return {name: (kind, t if i in on_host else t.clone())
                for i, (name, kind, t) in enumerate(zip(table.names, kinds, mapped))}
    return dict(zip(table.names, zip(kinds, mapped)))


def _apply_entries(model: Any, tensors: dict[str, tuple[str, Any]], manifest: Manifest, made: list) -> Any:
    """Install ``tensors``, the aliases and the attributes of ``manifest`` into the skeleton ``model``
    (:func:`.state.install`, whose :class:`.state.InstallError` it raises; ``made``: the small tensors the
    skeleton's constructor made on the real device, which cached tensors of their names replace in place, and
    the manifest's ``constructed.dropped`` are removed). Returns what install leaves to :func:`_reprocess`'s audit
    (:class:`.state.Installed`)."""
    from ..memory.state import install

    # consume: map_model drops ``tensors`` right after, so install may take the aliases over as they are
    return install(model, tensors, manifest.aliases, manifest.reprocess, manifest.attrs, manifest.object_attrs,
                   consume=True, made=made, dropped=manifest.constructed.dropped)


def _record_restore_device(model: Any, device: Any) -> None:
    """The skeleton was built on the meta device, so vLLM recorded meta as the device its in-place reload
    materializes each module on; record the engine's ``device`` instead (:func:`.reload.record_restore_device`)."""
    from .reload import record_restore_device

    record_restore_device(model, device)


def _reprocess(model: Any, manifest: Manifest, model_config: Any, transport: Transport, device: Any,
               done: Any) -> None:
    """Run post-processing of the processing units the daemon marked, on the installed tensors, wait until the
    device is done (copies in ``copy`` mode included), then audit the model (:func:`.state.audit` with ``done``,
    install's :class:`.state.Installed`: no meta tensor left once the references to replaced skeleton tensors were
    pointed at the installed ones and the skeleton tensors the daemon did not export were removed, every object
    the daemon's post-processing bound bound again), whose :class:`.state.InstallError` it raises: the fallback
    policy's case, not an engine that dies at its first forward."""
    from ..memory.state import audit, reprocess_modules

    reprocess_modules(model, manifest.reprocess, model_config)
    transport.synchronize(device)
    audit(model, manifest.objects, done)


def _send_release(lease: MappedLease, device: Any) -> None:
    """``copy`` mode, the clones complete: tell the daemon it may free its memory, close the connection and this
    process's mapping (no tensor views it any more)."""
    freed = lease.release()
    lease.close()
    lease.segment.close()
    logger.info("fastload: copy mode: daemon %s its memory", "freed" if freed else "kept (zero_copy clients)")
    if freed and lease.transport.device_memory:
        # vLLM's profiler took its free-memory baseline while the daemon held these bytes; freeing them during
        # the load would read as negative non-torch memory and grow the KV cache beyond gpu_memory_utilization.
        # Counting them once more as weights cancels that; vLLM with the external-memory hook needs no help.
        from .accounting import count_as_weights, has_external_weight_hook

        if not has_external_weight_hook():
            count_as_weights(device.index, lease.segment.size)


def _keep_lease(lease: MappedLease, device: Any, model: Any) -> None:
    """``zero_copy`` mode: keep the lease for the process's life, count device memory it maps as this engine's
    weights (:mod:`.accounting`) and, where the mapping shares writes with the daemon, make ``model``'s own
    ``load_weights`` refuse (:func:`.reload.guard_direct_loads`)."""
    from .reload import guard_direct_loads

    _LEASES.append(lease)
    guard_direct_loads(model, lease)
    if lease.transport.device_memory:
        from .accounting import count_as_weights

        count_as_weights(device.index, lease.segment.size)


def _report(manifest: Manifest, path: str, fp: Any, plan: Any, mode: Mode, phases: _Phases, t0: float) -> LoadReport:
    """The load report of a mapped load; ``weights_phase_s`` is the span comparable to a disk loader's weight
    loading (fetch + map + verify + install, + the copy and release), ``thread_cpu_s`` far below the wall time
    means the load waited (device copies, the daemon, other threads holding the GIL). ``content_digest``: the
    daemon's, when it hashed its load (then the log line names it: what an ``expected_content_digest`` matched)."""
    phases["thread_cpu_s"] = phases.thread_cpu_s()
    phases["weights_phase_s"] = round(phases["connect_manifest_s"] + phases["map_verify_install_s"]
                                      + phases["release_s"], 4)
    n_re = len(manifest.reprocess)
    report = LoadReport(load_format=LOAD_FORMAT, source=path, verb="mapped", tensors=len(manifest.tensors),
                        bytes=manifest.tensors.total_bytes(), wall_s=time.perf_counter() - t0,
                        fingerprint=fp.short(), weights_phase_s=phases["weights_phase_s"],
                        note=f"no disk read (re-processing {n_re} module(s) {phases['reprocess_s']:.3f} s)",
                        shards=len(plan.files), content_digest=manifest.content_digest)
    report.extra.update(mode=mode, reprocessed_modules=n_re, **phases)
    return report


def _process_registries(vllm_config: Any) -> list[dict]:
    """The process-wide dicts building a model registers into: attention layers in ``static_forward_context``
    and cached rotary embeddings (``rotary_embedding._ROPE_DICT``); those missing in this vLLM are left out."""
    found = [getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None)]
    try:
        from vllm.model_executor.layers import rotary_embedding as rope

        found.append(getattr(rope, "_ROPE_DICT", None))
    except ImportError:
        pass
    return [d for d in found if d is not None]


def _skeleton_registrations(vllm_config: Any) -> list[tuple[dict, set]]:
    """The keys of :func:`_process_registries` now, so a failed mapping can undo what its skeleton added. Its
    first call may import vLLM's rotary-embedding module, so it runs inside the skeleton's phase."""
    return [(d, set(d)) for d in _process_registries(vllm_config)]


def _forget_skeleton(before: list[tuple[dict, set]]) -> None:
    """Remove what a skeleton built after :func:`_skeleton_registrations` registered, so the fallback loader can
    build the model again (otherwise vLLM raises "Duplicate layer name" or reuses meta-device RoPE caches)."""
    for d, keys in before:
        for k in set(d) - keys:
            d.pop(k, None)
