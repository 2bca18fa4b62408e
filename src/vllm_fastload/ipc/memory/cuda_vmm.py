"""CUDA transport: one physical allocation per rank, shared as a POSIX file descriptor (CUDA VMM).

The daemon allocates the rank's export buffer with ``cuMemCreate`` (requested handle type
``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``), maps it into its address space, copies every exported tensor into it
and exports the allocation with ``cuMemExportToShareableHandle``. The file descriptor travels over the 0600 Unix
socket with SCM_RIGHTS, exactly like the CPU transport's memfd. The engine imports it
(``cuMemImportFromShareableHandle``), reserves a virtual range, maps and enables access (``cuMemAddressReserve``,
``cuMemMap``, ``cuMemSetAccess``), and builds every tensor as a view into that one range by offset.

Why VMM file descriptors and not legacy ``cudaIpcGetMemHandle`` handles (what PyTorch's reductions use): the
physical memory of a VMM allocation lives as long as any process holds a handle or a mapping of it (CUDA Driver
API, "Virtual Memory Management": ``cuMemRelease`` frees the memory only once every mapping is unmapped), so an
engine keeps serving when the daemon is SIGKILLed — the same guarantee as the memfd on CPU; the export does not
depend on the PyTorch caching allocator (works the same with ``expandable_segments:True``); and the handle is a file
descriptor, so only processes that received it over the private socket can map the memory (how the transport
is measured: ``benchmarks/ipc_probe.py``).

Bindings are ``ctypes`` on ``libcuda.so.1`` (the driver every CUDA PyTorch needs). Struct layouts follow
``cuda.h`` (``CUmemAllocationProp``, ``CUmemLocation``, ``CUmemAccessDesc``). ROCm: HIP offers the same API
(``hipMemCreate`` ...) but this module binds CUDA only; on ROCm ``ipc_cache`` falls back with a clear reason
(:func:`.backends.get_transport`). :class:`CudaVmmTransport` is this module's :class:`.transport.Transport`.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional

from ...errors import FastloadError, ManifestError
from ..wire.messages import SegmentMeta
from .transport import Segment, Transport

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
#: From this many checksum windows on, :meth:`CudaVmmTransport.read_windows` gathers them with one kernel instead
#: of one driver copy each.
GATHER_MIN_WINDOWS = 1024


class CudaVmmError(FastloadError):
    """A CUDA driver call of the VMM transport failed; the message names the call and the CUDA error."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_LIB: Optional[ctypes.CDLL] = None


def _lib() -> ctypes.CDLL:
    global _LIB
    if _LIB is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CudaVmmError(f"cannot load the CUDA driver (libcuda.so.1): {e}") from None
        rc = lib.cuInit(0)
        if rc != 0:
            raise CudaVmmError(f"cuInit failed with CUDA error {rc}")
        _LIB = lib
    return _LIB


def _check(rc: int, call: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        _lib().cuGetErrorName(rc, ctypes.byref(name))
        raise CudaVmmError(f"{call} failed: {(name.value or b'?').decode()} (CUDA error {rc})")


def _prop(device: int) -> _Prop:
    p = _Prop()
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED
    p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = device
    return p


def _make_current(device: int) -> None:
    """Make the device's primary context current on this thread (PyTorch uses the primary context too)."""
    import torch

    torch.cuda.set_device(device)
    torch.cuda.current_stream(device)  # forces the runtime to bind the primary context to this thread
    lib = _lib()
    ctx = ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def copy_to_host_async(device: int, copies: list[tuple[int, int, int]], stream: int) -> None:
    """Enqueue one ``cuMemcpyDtoHAsync`` per ``(host pointer, device pointer, bytes)`` on ``stream`` (a ``CUstream``
    handle such as ``torch.cuda.Stream.cuda_stream``; 0 is the legacy default stream) of CUDA device ``device``.

    The host memory must be page-locked (else the driver copies synchronously) and stay alive, unread, until the
    stream is synchronized; the caller synchronizes. One driver call per copy instead of a ``Tensor.copy_`` each
    (slicing, dispatch and the pinned allocator's event record per call): the engine's checksum windows are
    hundreds of 4 KiB copies. Raises :class:`CudaVmmError` naming the copy that failed.
    """
    _make_current(device)
    fn = _lib().cuMemcpyDtoHAsync_v2
    fn.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    for host, dev, nbytes in copies:
        rc = fn(host, dev, nbytes, stream)
        if rc:
            _check(rc, f"cuMemcpyDtoHAsync({nbytes} bytes from 0x{dev:x})")


def granularity(device: int) -> int:
    """The minimum VMM allocation granularity of ``device`` in bytes (2 MiB on current NVIDIA GPUs)."""
    g = ctypes.c_size_t()
    _check(_lib().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(_prop(device)),
                                                CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
    return int(g.value)


class _Cai:
    """Minimal ``__cuda_array_interface__`` (v3) exporter so ``torch.as_tensor`` wraps raw device memory without a
    copy. The wrapping tensor keeps this object (and through it the :class:`VmmBuffer`) alive."""

    def __init__(self, ptr: int, nbytes: int, owner: Any):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class VmmBuffer:
    """A mapped VMM allocation of ``size`` bytes on CUDA device ``device`` (an index as PyTorch sees it).

    Create with :meth:`allocate` (daemon) or :meth:`import_fd` (engine). :meth:`tensor` is a flat ``torch.uint8``
    view of the whole range (no copy). :meth:`close` unmaps and drops this process's handle; the physical memory is
    freed once no process maps or holds it. Raises :class:`CudaVmmError` naming the failing driver call.
    """

    def __init__(self, device: int, size: int, handle: int, ptr: int):
        self.device, self.size, self.handle, self.ptr = device, size, handle, ptr
        self._view = None

    @classmethod
    def allocate(cls, device: int, nbytes: int) -> VmmBuffer:
        """Allocate at least ``nbytes`` (rounded up to :func:`granularity`) of device memory, exportable as an fd."""
        _make_current(device)
        lib = _lib()
        g = granularity(device)
        size = max(g, -(-int(nbytes) // g) * g)
        handle = ctypes.c_ulonglong()
        _check(lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(_prop(device)),
                               ctypes.c_ulonglong(0)), f"cuMemCreate({size} bytes on cuda:{device})")
        try:
            ptr = cls._map(device, handle.value, size)
        except CudaVmmError:
            lib.cuMemRelease(handle)
            raise
        return cls(device, size, handle.value, ptr)

    @classmethod
    def import_fd(cls, device: int, fd: int, size: int) -> VmmBuffer:
        """Import an allocation exported by :meth:`export_fd` (received over SCM_RIGHTS) and map it; closes
        ``fd`` (the imported handle keeps the memory alive)."""
        try:
            _make_current(device)
            lib = _lib()
            handle = ctypes.c_ulonglong()
            _check(lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd),
                                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                   "cuMemImportFromShareableHandle")
        finally:
            os.close(fd)
        try:
            ptr = cls._map(device, handle.value, int(size))
        except CudaVmmError:
            lib.cuMemRelease(handle)
            raise
        return cls(device, int(size), handle.value, ptr)

    @staticmethod
    def _map(device: int, handle: int, size: int) -> int:
        lib = _lib()
        ptr = ctypes.c_ulonglong()
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                       ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        try:
            _check(lib.cuMemMap(ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_ulonglong(handle),
                                ctypes.c_ulonglong(0)), "cuMemMap")
            desc = _AccessDesc()
            desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = device
            desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            rc = lib.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1))
            if rc != 0:
                lib.cuMemUnmap(ptr, ctypes.c_size_t(size))
                _check(rc, "cuMemSetAccess")
        except CudaVmmError:
            lib.cuMemAddressFree(ptr, ctypes.c_size_t(size))
            raise
        return int(ptr.value)

    def export_fd(self) -> int:
        """A new POSIX file descriptor for this allocation (the caller sends and closes it)."""
        fd = ctypes.c_int(-1)
        _check(_lib().cuMemExportToShareableHandle(ctypes.byref(fd), ctypes.c_ulonglong(self.handle),
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, ctypes.c_ulonglong(0)),
               "cuMemExportToShareableHandle")
        return int(fd.value)

    def tensor(self) -> Any:
        """The whole range as a flat ``torch.uint8`` CUDA tensor of ``size`` elements (shares the memory)."""
        import torch

        if self._view is None:
            self._view = torch.as_tensor(_Cai(self.ptr, self.size, self), device=f"cuda:{self.device}")
            if self._view.data_ptr() != self.ptr:  # pragma: no cover - torch copied instead of wrapping
                raise CudaVmmError("torch.as_tensor copied the VMM range instead of wrapping it")
        return self._view

    def close(self) -> None:
        """Unmap, free the address range and release this process's handle. Tensors viewing the range must be
        gone (using them afterwards is an illegal memory access)."""
        if not self.ptr:
            return
        import torch

        _make_current(self.device)
        torch.cuda.synchronize(self.device)
        self._view = None
        lib = _lib()
        size = ctypes.c_size_t(self.size)
        _check(lib.cuMemUnmap(ctypes.c_ulonglong(self.ptr), size), "cuMemUnmap")
        _check(lib.cuMemAddressFree(ctypes.c_ulonglong(self.ptr), size), "cuMemAddressFree")
        _check(lib.cuMemRelease(ctypes.c_ulonglong(self.handle)), "cuMemRelease")
        self.ptr = 0


class CudaVmmTransport(Transport):
    """The ``cuda_vmm`` backend of :class:`.transport.Transport`: one :class:`VmmBuffer` per segment, on the CUDA
    device of this process (its index as PyTorch sees it)."""

    name = "cuda_vmm"
    device_memory = True
    #: engines map the allocation PROT_READWRITE (``CU_MEM_ACCESS_FLAGS_PROT_READWRITE``): a write changes the
    #: daemon's memory and what every other zero_copy engine reads
    shares_writes = True

    def resolve(self, device: Any) -> Any:
        """The current CUDA device of this process (a rank uses one; :meth:`bind_rank` chose it in the daemon)."""
        import torch

        return torch.device("cuda", torch.cuda.current_device())

    def bind_rank(self, local_rank: int) -> None:
        """Make CUDA device ``local_rank`` this process's current device."""
        import torch

        torch.cuda.set_device(local_rank)

    def allocate(self, size: int, device: Any) -> Segment:
        """A new VMM allocation of at least ``size`` bytes (rounded up to :func:`granularity`), exported as an fd."""
        vb = VmmBuffer.allocate(self.resolve(device).index, size)
        return Segment(vb.export_fd(), vb.size, self.name, vb.tensor(), vb)

    def describe(self, segment: Segment, device: Any) -> SegmentMeta:
        """The segment's size and transport, and the GPU it lives on (so an engine of another GPU refuses it)."""
        from ..wire.paths import device_identity

        return SegmentMeta(size=segment.size, transport=self.name,
                           device=device_identity("cuda", self.resolve(device).index))

    def open(self, fd: int, meta: SegmentMeta, device: Any) -> Segment:
        """Import and map the allocation (closes ``fd``). Raises :class:`~vllm_fastload.errors.ManifestError` when
        it is not a VMM segment or lives on another GPU than ``device``; :class:`CudaVmmError` when a driver call
        fails."""
        from ..wire.paths import device_identity

        self.check(fd, meta, device)
        index = self.resolve(device).index
        mine = device_identity("cuda", index)
        if meta.device and meta.device != mine:
            os.close(fd)
            raise ManifestError(f"the daemon exports memory of {meta.device} but this rank uses {mine} (cuda:{index}); "
                                f"check CUDA_VISIBLE_DEVICES and the socket path")
        vb = VmmBuffer.import_fd(index, fd, meta.size)
        return Segment(-1, meta.size, self.name, vb.tensor(), vb)

    def synchronize(self, device: Any) -> None:
        """``torch.cuda.synchronize`` of ``device``."""
        import torch

        torch.cuda.synchronize(device)

    def free_cached(self, device: Any) -> None:
        """Give PyTorch's cached blocks back to the driver (the daemon collected the dropped model's cycles
        first)."""
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def read_windows(self, buf: Any, starts: list[int], lens: list[int], width: int) -> Any:
        """Up to :data:`GATHER_MIN_WINDOWS` windows: one driver copy each (:func:`copy_to_host_async`) into one
        pinned buffer, no kernel launch (in a fresh engine process the first launch of a kernel costs more than a
        few copies). More: the windows that lie inside ``buf`` with one gather kernel and one copy
        (:func:`.transport.gather_windows`; a driver call per window costs microseconds each, and a model's
        checksum windows are tens of thousands), the few at its end by driver copies."""
        import numpy as np

        from .transport import gather_windows

        if len(starts) < GATHER_MIN_WINDOWS:
            return self._copied(buf, starts, lens, width)
        s = np.asarray(starts, dtype=np.int64)
        inside = s + width <= buf.numel()
        rows = np.empty((len(s), width), dtype=np.uint8)
        rows[inside] = gather_windows(buf, s[inside], width)
        out = np.flatnonzero(~inside)
        if len(out):
            rows[out] = self._copied(buf, s[out].tolist(), [lens[i] for i in out.tolist()], width)
        return rows

    def _copied(self, buf: Any, starts: list[int], lens: list[int], width: int) -> Any:
        """The windows as rows of a ``(len(starts), width)`` ``numpy.uint8`` array, one driver copy each."""
        import torch

        host = torch.empty(len(starts) * width, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.current_stream(buf.device)
        h, d = host.data_ptr(), buf.data_ptr()
        try:
            spans = [(h + i * width, d + s, m) for i, (s, m) in enumerate(zip(starts, lens))]
            copy_to_host_async(buf.device.index, spans, stream.cuda_stream)
        finally:  # also when a copy failed: the ones queued before must land before `host` is reused
            stream.synchronize()
        return host.numpy().reshape(len(starts), width)
