"""H2D copies and their events issued through the CUDA driver API (ctypes on ``libcuda.so.1``), not PyTorch.

Why: the direct path (:mod:`.direct`) issues one host-to-device copy per read range (about 2,000 for a 16 GB
checkpoint in 8 MiB ranges) and records an event after most of them, on the loading thread, which also submits the
reads and hands the tensors to vLLM. The per-copy timeline (docs/benchmarks.md) found the copy engine idle while
that thread was busy elsewhere, and each ``Tensor.copy_`` + ``torch.cuda.Event().record()`` is dispatcher, tensor
and allocator bookkeeping around two driver calls. Here a copy is ``cuMemcpyHtoDAsync_v2`` on the copy stream and
an event ``cuEventRecord`` of a pooled ``CU_EVENT_DISABLE_TIMING`` event: two foreign calls that keep the GIL (they
only queue work; a blocking ``cuEventSynchronize`` releases it).

Opt-in (``FASTLOAD_H2D_DRIVER=1``) until measured to be faster on a GPU (docs/benchmarks.md). :func:`for_stream`
returns None, and the path copies with PyTorch, where the driver library cannot be loaded (CPU builds, ROCm), where
the calling thread has no current CUDA context, or where that context is not on the stream's device.

CUDA facts used (CUDA Driver API reference): ``cuMemcpyHtoDAsync`` is asynchronous for page-locked host memory
(memory from ``cuMemHostAlloc`` / ``cudaHostAlloc`` or registered with ``cuMemHostRegister`` /
``cudaHostRegister``, which is what the direct path's arena is); a ``CUstream`` is the same handle as the runtime's
``cudaStream_t`` (``torch.cuda.Stream.cuda_stream``); ``cuStreamWaitEvent`` waits for the event's state at the time
of the call, so an event may be recorded again afterwards; ``cuEventQuery`` returns ``CUDA_ERROR_NOT_READY`` (600)
while the work before the record has not completed; ``cuEventDestroy`` of an event not yet complete is allowed
(its resources are released once it completes).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Optional

from .knobs import env_switch

#: ``FASTLOAD_H2D_DRIVER=1``: the direct path issues its untimed copies and events through :class:`Driver`.
ENABLED = env_switch("FASTLOAD_H2D_DRIVER") is True
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CU_EVENT_DISABLE_TIMING = 0x2


class DriverError(RuntimeError):
    """A CUDA driver call failed: the message names the call and the driver's error name and code."""


class _Lib:
    """The driver entry points, typed: ``fast`` calls keep the GIL (``ctypes.PyDLL``: they only queue work),
    ``slow`` ones release it (``ctypes.CDLL``: they may block)."""

    def __init__(self, fast: Any, slow: Any):
        vp, u64, sz, uint = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint
        self.memcpy = self._fn(fast, "cuMemcpyHtoDAsync_v2", u64, vp, sz, vp)
        self.record = self._fn(fast, "cuEventRecord", vp, vp)
        self.query = self._fn(fast, "cuEventQuery", vp)
        self.wait = self._fn(fast, "cuStreamWaitEvent", vp, vp, uint)
        self.create = self._fn(fast, "cuEventCreate", ctypes.POINTER(vp), uint)
        self.destroy = self._fn(fast, "cuEventDestroy_v2", vp)
        self.ctx_current = self._fn(fast, "cuCtxGetCurrent", ctypes.POINTER(vp))
        self.ctx_device = self._fn(fast, "cuCtxGetDevice", ctypes.POINTER(ctypes.c_int))
        self.synchronize = self._fn(slow, "cuEventSynchronize", vp)
        self.error_name = self._fn(fast, "cuGetErrorName", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))

    @staticmethod
    def _fn(lib: Any, name: str, *argtypes: Any) -> Any:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
        return fn

    def check(self, rc: int, call: str) -> None:
        """Raise :class:`DriverError` for a ``CUresult`` other than ``CUDA_SUCCESS``."""
        if rc != CUDA_SUCCESS:
            name = ctypes.c_char_p()
            self.error_name(rc, ctypes.byref(name))
            raise DriverError(f"{call} failed: {(name.value or b'unknown error').decode()} ({rc})")


@functools.lru_cache(maxsize=1)
def _library() -> Optional[_Lib]:
    """The driver library of this process, or None where it cannot be loaded (no NVIDIA driver, a CPU build)."""
    try:
        return _Lib(ctypes.PyDLL("libcuda.so.1"), ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


class Event:
    """A recorded driver event from a :class:`Driver`'s pool, with the methods of ``torch.cuda.Event`` the direct
    path and its readers use: :meth:`query`, :meth:`synchronize` and :meth:`wait` (what ``torch.cuda.Stream.
    wait_event(event)`` calls). Dropping the last reference returns the handle to the pool."""

    __slots__ = ("_handle", "_driver")

    def __init__(self, handle: int, driver: Driver):
        self._handle, self._driver = handle, driver

    def query(self) -> bool:
        """Whether the work recorded before the event has completed. Raises :class:`DriverError`."""
        rc = self._driver._lib.query(self._handle)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self._driver._lib.check(rc, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        """Block (without the GIL) until the work recorded before the event has completed."""
        self._driver._lib.check(self._driver._lib.synchronize(self._handle), "cuEventSynchronize")

    def wait(self, stream: Any) -> None:
        """Make the work queued on ``stream`` (a ``torch.cuda.Stream``) from now on wait for this event."""
        self._driver._lib.check(self._driver._lib.wait(stream.cuda_stream, self._handle, 0), "cuStreamWaitEvent")

    def __del__(self) -> None:
        self._driver._give_back(self._handle)


class Driver:
    """Copies and events on one CUDA stream through the driver API (module docstring). :meth:`copy` queues an H2D
    copy, :meth:`record` an event after everything queued so far. :meth:`close` (after the stream's work is waited
    for or no longer matters) destroys the pooled events; events still referenced are destroyed when dropped."""

    def __init__(self, lib: _Lib, stream_handle: int):
        self._lib, self._stream = lib, stream_handle
        self._pool: list[int] = []
        self._lock = threading.Lock()  # events are dropped on whichever thread drops the last reference
        self._closed = False
        self.copies = 0

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy of ``nbytes`` bytes from page-locked host address ``src`` to device address ``dst``."""
        self._lib.check(self._lib.memcpy(dst, src, nbytes, self._stream), "cuMemcpyHtoDAsync")
        self.copies += 1

    def record(self) -> Event:
        """An event recorded on the stream after every copy queued so far."""
        with self._lock:
            handle = self._pool.pop() if self._pool else None
        if handle is None:
            h = ctypes.c_void_p()
            self._lib.check(self._lib.create(ctypes.byref(h), CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            handle = h.value
        event = Event(handle, self)  # from here on a failure gives the handle back through the event
        self._lib.check(self._lib.record(handle, self._stream), "cuEventRecord")
        return event

    def _give_back(self, handle: int) -> None:
        with self._lock:
            if not self._closed:
                self._pool.append(handle)
                return
        self._lib.destroy(handle)

    def close(self) -> None:
        """Destroy the pooled events (idempotent)."""
        with self._lock:
            self._closed, pool, self._pool = True, self._pool, []
        for handle in pool:
            self._lib.destroy(handle)


def for_stream(stream: Any, lib: Optional[_Lib] = None) -> Optional[Driver]:
    """A :class:`Driver` for ``stream`` (a ``torch.cuda.Stream``) when :data:`ENABLED` and usable from the calling
    thread (module docstring), else None: the caller copies with PyTorch. ``lib``: the driver (tests pass a
    stand-in; default: ``libcuda.so.1``)."""
    if not ENABLED or stream is None:
        return None
    lib = lib or _library()
    if lib is None:
        return None
    ctx, dev = ctypes.c_void_p(), ctypes.c_int(-1)
    if lib.ctx_current(ctypes.byref(ctx)) != CUDA_SUCCESS or not ctx.value:
        return None
    if lib.ctx_device(ctypes.byref(dev)) != CUDA_SUCCESS or dev.value != getattr(stream.device, "index", None):
        return None
    return Driver(lib, stream.cuda_stream)
