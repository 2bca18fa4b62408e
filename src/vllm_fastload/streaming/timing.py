"""Seconds and bytes of one load's stages, measured where the work happens and handed to the load report whole.

The read paths (:mod:`.pipeline`, :mod:`.direct`, the loader's CPU path) fill one :class:`StageTimes` per load;
:meth:`StageTimes.feed` then gives every figure to :class:`~vllm_fastload.report.LoadReport`: a figure whose name
is a field of the report goes to that field, every other stage to ``report.extra`` under its own name. A stage
that a path does not have stays None and is left out of the report, so the report names only what happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional


def next_timed(it: Iterator[Any]) -> tuple[Any, float]:
    """``(next item of it, or None at its end; seconds spent waiting for it)``."""
    t = time.perf_counter()
    try:
        item = next(it)
    except StopIteration:
        item = None
    return item, time.perf_counter() - t


@dataclass
class StageTimes:
    """Seconds per stage and bytes of one load (see :class:`~vllm_fastload.report.LoadReport`).

    Always measured: ``read_wait_s``, seconds waiting for the reader; ``bytes``, bytes delivered (to the device on
    a GPU); ``tensors``, tensors delivered. Stages, None where the path has none (:meth:`measures` declares them):
    ``slot_wait_s``, seconds waiting for a pinned slot's previous H2D copy (PCIe bound when large); ``h2d_s``, GPU
    seconds of the H2D copies (CUDA events, summed by :meth:`settle_h2d`, estimated from a sample where the path
    times only every few copies); ``memcpy_s``, seconds of host copies
    into pinned slots; ``consumer_wait_s``, seconds the consumer waited for a producer thread; ``driver_copies``,
    H2D copies issued through the CUDA driver API (:mod:`.cudriver`).
    """

    read_wait_s: float = 0.0
    bytes: int = 0
    tensors: int = 0
    slot_wait_s: Optional[float] = None
    h2d_s: Optional[float] = None
    memcpy_s: Optional[float] = None
    consumer_wait_s: Optional[float] = None
    #: copies issued through the CUDA driver API (:mod:`.cudriver`), None where the path did not use it
    driver_copies: Optional[int] = None
    #: a :class:`.timeline.CopyTimeline` every copy of :meth:`h2d_copy` is recorded in (a benchmark's diagnostic)
    timeline: Optional[Any] = field(default=None, repr=False)
    _events: list = field(default_factory=list, repr=False)
    _copied_bytes: int = field(default=0, repr=False)
    _timed_bytes: int = field(default=0, repr=False)

    def measures(self, *stages: str) -> StageTimes:
        """Declare ``stages`` (field names) as stages of this load: from None to 0.0 (a value already counted
        stays). Returns ``self``."""
        for name in stages:
            if getattr(self, name) is None:
                setattr(self, name, 0.0)
        return self

    @contextlib.contextmanager
    def clock(self, stage: str) -> Iterator[None]:
        """Add the seconds the block takes to ``stage`` (declared by :meth:`measures`)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, stage, getattr(self, stage) + time.perf_counter() - t)

    def h2d_copy(self, dst: Any, src: Any, stream: Any, timed: bool = True, event: bool = True) -> Any:
        """Issue ``dst.copy_(src, non_blocking=True)`` (torch tensors of equal size, ``src`` in pinned host
        memory) on CUDA ``stream`` (None: the current stream, already the copy stream) and return an event recorded
        after it. ``timed``: between two timing events whose GPU seconds join ``h2d_s`` at :meth:`settle_h2d`;
        an untimed copy only counts its bytes, and :meth:`settle_h2d` scales the timed copies' seconds up to every
        copied byte (a path that issues thousands of copies times a sample: every event is a driver call). With a
        :attr:`timeline` every copy is timed through it instead. ``event`` False (and not ``timed``, no timeline):
        no event after the copy, None returned."""
        import torch

        n = dst.numel() * dst.element_size()
        self._copied_bytes += n
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if self.timeline is not None:
                start, end = self.timeline.copy(dst, src)
                timed = True
            else:
                if timed:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record()
                dst.copy_(src, non_blocking=True)
                if not (timed or event):
                    return None
                end = torch.cuda.Event(enable_timing=timed)
                end.record()
        if timed:
            self._events.append((start, end))
            self._timed_bytes += n
        return end

    def count_copy(self, nbytes: int) -> None:
        """Count an untimed H2D copy of ``nbytes`` bytes issued outside :meth:`h2d_copy` (the driver path): its
        bytes join the copied bytes :meth:`settle_h2d` scales the timed copies' seconds up to."""
        self._copied_bytes += nbytes

    def settle_h2d(self) -> None:
        """Sum the GPU seconds of the timed copies :meth:`h2d_copy` issued into ``h2d_s``, scaled by copied bytes
        over timed bytes (their streams must have finished them), and forget their events. A :attr:`timeline` is
        written to its file then and dropped."""
        if self.timeline is not None:
            timeline, self.timeline = self.timeline, None
            try:
                timeline.write()
            except OSError as e:  # a diagnostic must not fail a load whose weights are all in place
                from ..log import logger

                logger.warning("fastload: could not write the H2D timeline to %s (%s)", timeline.path, e)
        timed = sum(s.elapsed_time(e) for s, e in self._events) / 1e3
        self.h2d_s = timed * self._copied_bytes / self._timed_bytes if self._timed_bytes else timed
        self._events.clear()
        self._copied_bytes = self._timed_bytes = 0

    def feed(self, report: Any) -> None:
        """Give these figures to ``report`` (a :class:`~vllm_fastload.report.LoadReport`): a figure named like a
        report field sets that field; every other stage that is not None goes to ``report.extra``, seconds rounded
        to 0.1 ms."""
        fields = {f.name for f in dataclasses.fields(report)}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("_") or value is None:
                continue
            if f.name in fields:
                setattr(report, f.name, value)
            else:
                report.extra[f.name] = round(value, 4)
