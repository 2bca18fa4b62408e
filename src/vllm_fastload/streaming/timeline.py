"""Where the copy engine waits during a direct GPU load: a per-copy timeline, for the benchmarks (off by default).

With ``FASTLOAD_H2D_TIMELINE`` set to a file path, the direct read path (:func:`.direct.stream_tensors` on CUDA)
records for every H2D copy when the loading thread asked the reader for the piece, when it got it, when the copy
was issued (host ``perf_counter`` seconds) and when the copy started and ended on the GPU (two CUDA timing events
per copy), and writes them with :func:`summarize`'s account to that file (JSON) when the load ends. Every event is
a driver call, so a timed load is a little slower than an untimed one; the load report says the timeline was on
(``h2d_timeline``). Every load of the process writes the same file, the last one wins: it is meant for one
engine at TP=1 (``benchmarks/load_bench.py``'s ``runai_fastload_uringtl``).

The account answers the question the load report's sums cannot: of the seconds between the first request and the
last copy's end, how many the copy engine was copying, and, for each stretch it stood idle, whether the loading
thread was waiting for a read then (the reads were behind) or doing something else (vLLM's ``weight_loader``, the
allocator, Python: the issue was behind). Host and GPU clocks are tied by one event the host waits for at the start
(CUDA events have about 0.5 us resolution, CUDA Runtime API ``cudaEventElapsedTime``); an idle stretch shorter
than :data:`LAUNCH_S` counts as launch latency, not as either.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

#: Environment variable naming the file a direct GPU load writes its timeline to (unset or empty: no timeline).
ENV = "FASTLOAD_H2D_TIMELINE"
#: Idle seconds between two copies below which the gap is counted as the launch of the next copy.
LAUNCH_S = 20e-6


def requested() -> Optional[str]:
    """The path in ``FASTLOAD_H2D_TIMELINE``, or None when it is unset or empty."""
    return os.environ.get(ENV) or None


class CopyTimeline:
    """Records one load's H2D copies (see module docstring) and writes them to ``path`` at :meth:`write`.

    ``stream``: the CUDA stream the copies are issued on (its first event is the clocks' common zero). Not
    thread-safe: the thread that issues the copies calls :meth:`got` and :meth:`copy`."""

    def __init__(self, path: str, stream: Any):
        import torch

        self.path = Path(path)
        self._torch = torch
        self._ref = torch.cuda.Event(enable_timing=True)
        self._ref.record(stream)
        self._ref.synchronize()
        self._t0 = time.perf_counter()  # the host's time of the reference event, to within a synchronize's return
        self._rows: list[list[Any]] = []  # [ask, got, issued, start event, end event, bytes]
        self._asked = self._got = 0.0

    def got(self, waited_s: float) -> None:
        """The loading thread just got a piece from the reader after waiting ``waited_s`` seconds for it."""
        now = time.perf_counter() - self._t0
        self._asked, self._got = now - waited_s, now

    def copy(self, dst: Any, src: Any) -> tuple[Any, Any]:
        """Issue ``dst.copy_(src, non_blocking=True)`` on the current stream between two timing events; returns
        both (the end event: what the caller waits on or records the slot's reuse with)."""
        torch = self._torch
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        issued = time.perf_counter() - self._t0
        self._rows.append([self._asked, self._got, issued, start, end, dst.numel() * dst.element_size()])
        return start, end

    def write(self) -> dict:
        """Wait for the recorded copies, write ``{"summary": ..., "copies": [...]}`` to the path (each copy: ask,
        got, issued, start, end in seconds from the reference event, and bytes) and return the summary. Creates
        the file's directory; a failure to write raises ``OSError``."""
        rows = []
        for ask, got, issued, start, end, n in self._rows:
            end.synchronize()
            rows.append([round(ask, 6), round(got, 6), round(issued, 6),
                         round(self._ref.elapsed_time(start) / 1e3, 6), round(self._ref.elapsed_time(end) / 1e3, 6), n])
        self._rows.clear()
        summary = summarize(rows)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"summary": summary, "columns": ["ask_s", "got_s", "issued_s", "start_s",
                                                                         "end_s", "bytes"], "copies": rows}))
        return summary


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def summarize(rows: list[list[float]]) -> dict:
    """The account of a timeline: ``rows`` are ``[ask, got, issued, start, end, bytes]`` per copy in issue order
    (seconds on one clock, bytes).

    Returns seconds: ``span_s`` (first ask to last copy's end), ``copying_s`` (the copies' GPU time, one stream so
    they never overlap), ``first_copy_s`` (first ask to the first copy's start: the first read), ``idle_s`` (the
    gaps between copies), split into ``idle_read_s`` (the loading thread was waiting for the reader during the gap),
    ``idle_issue_s`` (it was not: busy elsewhere before it issued the next copy) and ``idle_launch_s`` (gaps under
    :data:`LAUNCH_S` and what neither explains); also ``copies``, ``bytes``, ``copy_gb_per_s`` (bytes over copying
    seconds, 1e9 bytes per GB), and ``largest_gaps`` (the five longest gaps: copy index, start of the gap, seconds,
    read-wait seconds in it). ``{}`` for no rows."""
    if not rows:
        return {}
    copying = sum(r[4] - r[3] for r in rows)
    nbytes = sum(r[5] for r in rows)
    idle = read = issue = launch = 0.0
    gaps = []
    for i in range(1, len(rows)):
        prev_end = rows[i - 1][4]
        ask, got, issued, start = rows[i][0], rows[i][1], rows[i][2], rows[i][3]
        gap = start - prev_end
        if gap <= 0:
            continue
        idle += gap
        if gap < LAUNCH_S:
            launch += gap
            continue
        waiting = _overlap(prev_end, start, ask, got)
        # the loading thread, not waiting for the reader, had not yet issued this copy
        busy = _overlap(prev_end, start, -1e30, issued) - waiting
        busy = max(0.0, busy)
        read += waiting
        issue += busy
        launch += max(0.0, gap - waiting - busy)
        gaps.append((gap, i, prev_end, waiting))
    gaps.sort(reverse=True)
    span = rows[-1][4] - rows[0][0]
    return {
        "copies": len(rows),
        "bytes": nbytes,
        "span_s": round(span, 6),
        "first_copy_s": round(rows[0][3] - rows[0][0], 6),
        "copying_s": round(copying, 6),
        "copy_gb_per_s": round(nbytes / copying / 1e9, 2) if copying > 0 else None,
        "idle_s": round(idle, 6),
        "idle_read_s": round(read, 6),
        "idle_issue_s": round(issue, 6),
        "idle_launch_s": round(launch, 6),
        "largest_gaps": [{"copy": i, "at_s": round(at, 6), "gap_s": round(g, 6), "read_wait_s": round(w, 6)}
                         for g, i, at, w in gaps[:5]],
    }
