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

PyTorch facts used (docs "CUDA semantics", "Tensor.record_stream"): ``non_blocking=True`` host-to-device
copies are asynchronous only from pinned memory; a stream must ``wait_event`` before using data produced on
another stream; memory allocated on one stream and used on another needs ``record_stream``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StageTimes:
    """Seconds per stage of one load (see :class:`~vllm_fastload.report.LoadReport`).

    ``read_wait_s``: waiting for the reader; ``memcpy_s``: host copies into pinned slots; ``slot_wait_s``: waiting
    for a slot's previous H2D copy (PCIe bound when large); ``h2d_s``: GPU time of the H2D copies (events);
    ``bytes``: bytes copied to the device.
    """

    read_wait_s: float = 0.0
    memcpy_s: float = 0.0
    slot_wait_s: float = 0.0
    h2d_s: float = 0.0
    bytes: int = 0
    tensors: int = 0
    _events: list = field(default_factory=list, repr=False)


class H2DPipeline:
    """Copy host tensors to ``device`` through a pinned ring (see module docstring).

    ``slot_bytes`` (bytes per slot, > 0) and ``slots`` (>= 2) bound the pinned memory to ``slot_bytes * slots``.
    Use as a context manager; :meth:`close` waits for outstanding copies and frees the ring.
    """

    def __init__(self, device: torch.device, slot_bytes: int = 64 * 2**20, slots: int = 4, copy_threads: int = 8):
        if slot_bytes <= 0 or slots < 2:
            raise ValueError(f"pinned ring needs slot_bytes > 0 and slots >= 2, got {slot_bytes} x {slots}")
        self.device = torch.device(device)
        self.slot_bytes, self.slots = slot_bytes, slots
        self.ring = torch.empty(slot_bytes * slots, dtype=torch.uint8, pin_memory=True)
        self.slot_events: list[Any] = [None] * slots
        self.next_slot = 0
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self.pool = ThreadPoolExecutor(copy_threads) if copy_threads > 1 else None
        self.copy_threads = copy_threads
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

    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """Start copying host tensor ``src`` to the device; returns the device tensor (same dtype/shape).

        The consumer stream (current stream) is made to wait for the copy; the host ``src`` may be reused as
        soon as this returns (its bytes are already in a pinned slot).
        """
        consumer = torch.cuda.current_stream(self.device)
        if src.numel() == 0:
            return torch.empty(src.shape, dtype=src.dtype, device=self.device)
        flat = src.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        with torch.cuda.stream(self.copy_stream):
            dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst.record_stream(consumer)
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
        consumer.wait_event(end)
        self.times.bytes += nbytes
        self.times.tensors += 1
        return dst.view(src.dtype).view(src.shape)

    def run(self, named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Map ``(name, host tensor)`` to ``(name, device tensor)``, counting reader wait time."""
        while True:
            t = time.perf_counter()
            try:
                name, host = next(named)
            except StopIteration:
                self.times.read_wait_s += time.perf_counter() - t
                return
            self.times.read_wait_s += time.perf_counter() - t
            yield name, self.to_device(host)

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
