"""H2D copy bandwidth out of a small pinned ring, by how the ring was page-locked.

Copies 16 GiB to the GPU in ``--chunk`` MiB pieces cycling through a ring of ``--slots`` pieces (the shape of the
direct read path's slots), from (a) PyTorch's pinned allocator (``cudaHostAlloc``), (b) this package's
``streaming.hostmem.page_locked`` (anonymous mapping, ``MADV_HUGEPAGE``, ``cudaHostRegister``), (c) the same
without ``MADV_HUGEPAGE``. GPU time from CUDA events, alternating the kinds ``--repeat`` times; also how much of
each ring the kernel backs with huge pages (``/proc/self/smaps`` AnonHugePages), and what issuing one copy costs
the issuing thread (host microseconds of ``copy_(non_blocking=True)``, alone and with the event the direct read
path records after each copy, in bursts of one ring with the stream drained between bursts). Usage:
``PYTHONPATH=src python3 benchmarks/h2d_probe.py [--chunk 8] [--slots 16]``.
"""

from __future__ import annotations

import argparse
import mmap

import torch

from vllm_fastload.streaming import hostmem

MIB = 1 << 20


def huge_bytes(ptr: int) -> int:
    """AnonHugePages (bytes) of the mapping that contains address ``ptr``."""
    cur, out = None, 0
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            cur = lo <= ptr < hi
        elif cur and head[0] == "AnonHugePages:":
            out = int(head[1]) * 1024
    return out


def no_thp(nbytes: int) -> torch.Tensor:
    """``page_locked`` without the huge-page hint: 4 KiB pages registered."""
    saved = hostmem._advise
    hostmem._advise = lambda mm, name: saved(mm, name) if name != "MADV_HUGEPAGE" else mm.madvise(mmap.MADV_NOHUGEPAGE)
    try:
        return hostmem.page_locked(nbytes)
    finally:
        hostmem._advise = saved


def run(ring: torch.Tensor, dst: torch.Tensor, chunk: int, slots: int, total: int) -> float:
    """GB/s of ``total`` bytes copied from ``ring`` into ``dst`` in ``chunk``-byte pieces."""
    s = torch.cuda.Stream()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = total // chunk
    with torch.cuda.stream(s):
        a.record()
        for i in range(n):
            k = i % slots
            o = (i * chunk) % dst.numel()
            dst[o:o + chunk].copy_(ring[k * chunk:(k + 1) * chunk], non_blocking=True)
        b.record()
    b.synchronize()
    return total / (a.elapsed_time(b) / 1000) / 1e9


def issue_us(ring: torch.Tensor, dst: torch.Tensor, chunk: int, slots: int, bursts: int, event: bool) -> list:
    """Host microseconds per ``copy_`` issue (with ``event``: plus creating and recording a CUDA event after it),
    ``bursts`` bursts of ``slots`` copies, the stream synchronized between bursts (so no issue waits for a full
    queue)."""
    import time

    s = torch.cuda.Stream()
    out = []
    with torch.cuda.stream(s):
        for b in range(bursts):
            for k in range(slots):
                o = ((b * slots + k) * chunk) % dst.numel()
                d, src = dst[o:o + chunk], ring[k * chunk:(k + 1) * chunk]
                t = time.perf_counter()
                d.copy_(src, non_blocking=True)
                if event:
                    torch.cuda.Event().record()
                out.append((time.perf_counter() - t) * 1e6)
            s.synchronize()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    chunk, slots = args.chunk * MIB, args.slots
    nbytes = chunk * slots
    dst = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    rings = {"cudaHostAlloc": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
             "page_locked (THP hint)": hostmem.page_locked(nbytes),
             "page_locked, no THP": no_thp(nbytes)}
    for r in rings.values():
        r.fill_(1)
    run(rings["cudaHostAlloc"], dst, chunk, slots, 2 << 30)  # warm-up
    got = {k: [] for k in rings}
    for _ in range(args.repeat):
        for k, r in rings.items():
            got[k].append(run(r, dst, chunk, slots, 16 << 30))
    print(f"| ring ({args.slots} x {args.chunk} MiB) | huge-page bytes | H2D GB/s, each run |")
    print("|---|---|---|")
    for k, r in rings.items():
        print(f"| {k} | {huge_bytes(r.data_ptr())} | {', '.join(f'{v:.1f}' for v in got[k])} |")
    import statistics

    print("\n| ring | issue us per copy_ (median, p90) | copy_ + event record (median, p90) |")
    print("|---|---|---|")
    for k, r in rings.items():
        cols = []
        for event in (False, True):
            us = sorted(issue_us(r, dst, chunk, slots, 32, event))
            cols.append(f"{statistics.median(us):.1f}, {us[int(len(us) * 0.9)]:.1f}")
        print(f"| {k} | {cols[0]} | {cols[1]} |")


if __name__ == "__main__":
    main()
