"""Host-to-device pipeline: tensors from the reader -> pinned ring slots -> async H2D copies on a side stream.

Data flow per tensor (``H2DPipeline.run``)::

    reader (runai thread pool, host memory) --memcpy--> pinned slot i --copy_(non_blocking) on copy stream-->
    fresh device tensor; event per slot (slot i is reused only after its copy finished); one event per tensor
    that the consuming stream waits on before the model's ``weight_loader`` narrows it on the GPU.

* The ring is ``slots`` x ``slot_bytes`` of pinned (page-locked) host memory, allocated once per load and
  released at the end. A tensor larger than a slot is copied in slot-sized pieces into its device tensor, so
  the largest tensor never has to fit one slot.
* Every yielded tensor is its own device allocation (never a view into a reused buffer); it stays valid for as
  long as the consumer holds it. The allocation is made on the copy stream and ``record_stream``-ed on the
  consumer stream, as PyTorch's CUDA semantics notes prescribe for cross-stream use.
* The host memcpy into the slot is split across ``copy_threads`` threads (``Tensor.copy_`` releases the GIL),
  since vLLM workers often run with ``OMP_NUM_THREADS=1``.
* With ``threaded=True``, :meth:`H2DPipeline.run` drives reader, memcpy and copy issue from a producer thread,
  so they overlap with the consumer's ``weight_loader`` calls (measured slower on the H200, see
  docs/benchmarks.md; off by default); at most ``lookahead`` finished tensors wait in the hand-over queue, so
  transient device memory is bounded by about ``(lookahead + 2)`` x the largest tensor.

PyTorch facts used (docs "CUDA semantics", "Tensor.record_stream"): ``non_blocking=True`` host-to-device
copies are asynchronous only from pinned memory; a stream must ``wait_event`` before using data produced on
another stream; memory allocated on one stream and used on another needs ``record_stream``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch


def next_timed(it: Iterator[Any]) -> tuple[Any, float]:
    """``(next item or None at the end, seconds spent waiting for it)``."""
    t = time.perf_counter()
    try:
        item = next(it)
    except StopIteration:
        item = None
    return item, time.perf_counter() - t


@dataclass
class StageTimes:
    """Seconds per stage of one load (see :class:`~vllm_fastload.report.LoadReport`).

    ``read_wait_s``: waiting for the reader; ``memcpy_s``: host copies into pinned slots; ``slot_wait_s``: waiting
    for a slot's previous H2D copy (PCIe bound when large); ``h2d_s``: GPU time of the H2D copies (events);
    ``consumer_wait_s``: the consumer waiting for the producer thread; ``bytes``: bytes copied to the device.
    """

    read_wait_s: float = 0.0
    memcpy_s: float = 0.0
    slot_wait_s: float = 0.0
    h2d_s: float = 0.0
    consumer_wait_s: float = 0.0
    bytes: int = 0
    tensors: int = 0
    _events: list = field(default_factory=list, repr=False)


class H2DPipeline:
    """Copy host tensors to ``device`` through a pinned ring (see module docstring).

    ``slot_bytes`` (bytes per slot, > 0) and ``slots`` (>= 2) bound the pinned memory to ``slot_bytes * slots``.
    Use as a context manager; :meth:`close` waits for outstanding copies and frees the ring.
    """

    def __init__(self, device: torch.device, slot_bytes: int = 64 * 2**20, slots: int = 4, copy_threads: int = 8,
                 lookahead: int = 2, threaded: bool = False):
        if slot_bytes <= 0 or slots < 2:
            raise ValueError(f"pinned ring needs slot_bytes > 0 and slots >= 2, got {slot_bytes} x {slots}")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device(self.device.type, torch.cuda.current_device())
        self.slot_bytes, self.slots = slot_bytes, slots
        self.ring = torch.empty(slot_bytes * slots, dtype=torch.uint8, pin_memory=True)
        self.slot_events: list[Any] = [None] * slots
        self.next_slot = 0
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self.pool = ThreadPoolExecutor(copy_threads) if copy_threads > 1 else None
        self.copy_threads = copy_threads
        self.lookahead = max(1, lookahead)
        self.threaded = threaded
        self.times = StageTimes()

    # -- ring -------------------------------------------------------------------------------------------
    def _acquire(self) -> tuple[int, torch.Tensor]:
        i = self.next_slot
        self.next_slot = (i + 1) % self.slots
        ev = self.slot_events[i]
        if ev is not None:
            t = time.perf_counter()
            ev.synchronize()
            self.times.slot_wait_s += time.perf_counter() - t
        return i, self.ring[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def _memcpy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        n = src.numel()
        t = time.perf_counter()
        if self.pool is None or n < 8 * 2**20:
            dst[:n].copy_(src)
        else:
            step = -(-n // self.copy_threads)
            list(self.pool.map(lambda o: dst[o:o + step].copy_(src[o:o + step]), range(0, n, step)))
        self.times.memcpy_s += time.perf_counter() - t

    def to_device(self, src: torch.Tensor, consumer: Any = None) -> tuple[torch.Tensor, Any]:
        """Start copying host tensor ``src`` to the device. Returns ``(device tensor, event)``: the consumer must
        ``wait_event(event)`` (None for an empty tensor) before using it; :meth:`run` does.

        The device tensor is allocated on the copy stream and ``record_stream``-ed on ``consumer`` (default: the
        current stream). ``src`` may be reused as soon as this returns (its bytes are in pinned slots).
        """
        consumer = consumer or torch.cuda.current_stream(self.device)
        if src.numel() == 0:
            return torch.empty(src.shape, dtype=src.dtype, device=self.device), None
        flat = src.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        with torch.cuda.stream(self.copy_stream):
            dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst.record_stream(consumer)
        end = None
        for off in range(0, nbytes, self.slot_bytes):
            n = min(self.slot_bytes, nbytes - off)
            i, slot = self._acquire()
            self._memcpy(slot, flat[off:off + n])
            with torch.cuda.stream(self.copy_stream):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst[off:off + n].copy_(slot[:n], non_blocking=True)
                end.record()
            self.slot_events[i] = end
            self.times._events.append((start, end))
        self.times.bytes += nbytes
        self.times.tensors += 1
        return dst.view(src.dtype).view(src.shape), end

    def run(self, named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Map ``(name, host tensor)`` to ``(name, device tensor)``.

        A producer thread pulls from ``named`` (the reader), fills pinned slots and issues the copies; this
        generator hands each finished tensor to the consumer after making the current stream wait for it.
        Errors of the reader or the copy are re-raised here; closing this generator stops the producer.
        """
        consumer = torch.cuda.current_stream(self.device)
        if not self.threaded:
            yield from self._run_inline(named, consumer)
            return
        handoff: queue.Queue = queue.Queue(maxsize=self.lookahead)
        stop = threading.Event()
        errors: list[BaseException] = []
        end_mark = object()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    handoff.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                torch.cuda.set_device(self.device)
                while not stop.is_set():
                    item, waited = next_timed(named)
                    self.times.read_wait_s += waited
                    if item is None or not put((item[0], *self.to_device(item[1], consumer))):
                        break
            except BaseException as e:  # noqa: BLE001 - handed to the consumer thread
                errors.append(e)
            finally:
                close = getattr(named, "close", None)
                if close is not None:
                    close()
                put(end_mark)

        worker = threading.Thread(target=produce, name="fastload-h2d", daemon=True)
        worker.start()
        try:
            while True:
                t = time.perf_counter()
                item = handoff.get()
                self.times.consumer_wait_s += time.perf_counter() - t
                if item is end_mark:
                    break
                name, dst, event = item
                if event is not None:
                    consumer.wait_event(event)
                yield name, dst
        finally:
            stop.set()
            worker.join()
        if errors:
            raise errors[0]

    def _run_inline(self, named: Iterator[tuple[str, torch.Tensor]], consumer: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """``threaded=False``: reader, memcpy and copy issue run in the consumer's thread between its
        ``weight_loader`` calls; the copies themselves still run asynchronously on the copy stream."""
        while True:
            item, waited = next_timed(named)
            self.times.read_wait_s += waited
            if item is None:
                return
            dst, event = self.to_device(item[1], consumer)
            if event is not None:
                consumer.wait_event(event)
            yield item[0], dst

    def close(self) -> StageTimes:
        """Wait for all copies, sum the H2D GPU time, free the ring and the copy threads. Returns the timings."""
        self.copy_stream.synchronize()
        self.times.h2d_s = sum(s.elapsed_time(e) for s, e in self.times._events) / 1e3
        self.times._events.clear()
        self.slot_events = [None] * self.slots
        self.ring = None
        if self.pool is not None:
            self.pool.shutdown()
        return self.times

    def __enter__(self) -> "H2DPipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
