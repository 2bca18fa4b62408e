"""Can plain ``preadv`` threads read a warm page cache into pinned memory faster than runai's reader, with the H2D
copies overlapped? No vLLM, no runai: torch with CUDA and this package's ``streaming.hostmem`` only.

    PYTHONPATH=src python3 benchmarks/pread_probe.py [--dir D] [--gb 16] [--files 4] [--configs ...]

Writes ``--files`` files of ``--gb`` GB in total into ``--dir`` (kept and reused when their size matches; writing
leaves them in the page cache), then per config ``mode:threads:chunk_MiB:slots`` (mode ``read``: each thread
reads into its own pinned slot, no copy; ``h2d``: a ring of ``slots`` pinned slots, threads read, the main thread
issues one non-blocking H2D copy per chunk on a side stream, a recycler thread returns a slot after its copy's
event; ``self``: each thread reads into its own ``slots`` slots and issues the copies itself; ``reg``: threads
page-lock the page cache in place through a read-only mmap, ``cudaHostRegister`` with
``cudaHostRegisterReadOnly``, and unregister at once; ``regcopy``: the same, the main thread copies each locked
chunk to the GPU and a recycler unregisters it after the copy) times reading every byte once, ``--repeat`` times
(best and median printed). Also the pinned H2D bandwidth alone. Prints Markdown.
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import threading
import time
from pathlib import Path

import torch

MIB = 1 << 20
DEFAULT = ("h2d:16:32:32,h2d:16:8:64,h2d:16:4:32,h2d:16:2:48,h2d:16:1:96,h2d:12:4:24,h2d:16:16:24,"
           "self:16:8:2,self:16:16:2,self:16:4:3,self:16:32:2,self:12:8:3,self:24:8:2")


def make_files(d: Path, total: int, n: int) -> list[Path]:
    """``n`` files of ``total // n`` bytes each (random 64 MiB block repeated), reused when present at that size."""
    d.mkdir(parents=True, exist_ok=True)
    size = total // n
    block = os.urandom(64 * MIB)
    paths = []
    for k in range(n):
        p = d / f"shard-{k}.bin"
        if not p.exists() or p.stat().st_size != size:
            with open(p, "wb") as f:
                left = size
                while left:
                    left -= f.write(block[:min(left, len(block))])
        paths.append(p)
    return paths


def chunks_of(fds: list[int], size: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """``(fd, file offset, bytes, destination offset)`` of every chunk, file after file."""
    out, dst = [], 0
    for fd in fds:
        for off in range(0, size, chunk):
            n = min(chunk, size - off)
            out.append((fd, off, n, dst))
            dst += n
    return out


def pread_into(fd: int, buf, off: int) -> None:
    """Fill ``buf`` (a writable buffer) from ``fd`` at ``off``; raises on a short file."""
    view, done = memoryview(buf), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], off + done)
        if got <= 0:
            raise OSError(f"short read at {off + done}")
        done += got


def run_read(work, threads: int, chunk: int) -> float:
    """Seconds for ``threads`` threads to read every chunk, each into its own pinned slot."""
    from vllm_fastload.streaming.hostmem import page_locked

    arena = page_locked(threads * chunk)
    bufs = [arena[i * chunk:(i + 1) * chunk].numpy() for i in range(threads)]
    counter = itertools.count()

    def worker(k: int) -> None:
        while (i := next(counter)) < len(work):
            fd, off, n, _ = work[i]
            pread_into(fd, bufs[k][:n], off)

    t = time.perf_counter()
    ths = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return time.perf_counter() - t


def run_h2d(work, threads: int, chunk: int, slots: int, dst: torch.Tensor) -> float:
    """Seconds to read every chunk into a ring of ``slots`` pinned slots and copy it to ``dst`` on a side stream."""
    from vllm_fastload.streaming.hostmem import page_locked

    arena = page_locked(slots * chunk)
    tens = [arena[i * chunk:(i + 1) * chunk] for i in range(slots)]
    arrs = [x.numpy() for x in tens]
    free: queue.SimpleQueue = queue.SimpleQueue()
    for s in range(slots):
        free.put(s)
    done: queue.SimpleQueue = queue.SimpleQueue()
    pending: queue.SimpleQueue = queue.SimpleQueue()
    counter = itertools.count()
    stream = torch.cuda.Stream()

    def worker() -> None:
        while (i := next(counter)) < len(work):
            s = free.get()
            fd, off, n, _ = work[i]
            pread_into(fd, arrs[s][:n], off)
            done.put((i, s))

    def recycler() -> None:
        while (item := pending.get()) is not None:
            item[0].synchronize()
            free.put(item[1])

    t = time.perf_counter()
    ths = [threading.Thread(target=worker) for _ in range(threads)]
    rec = threading.Thread(target=recycler)
    rec.start()
    for th in ths:
        th.start()
    for _ in range(len(work)):
        i, s = done.get()
        _, _, n, doff = work[i]
        with torch.cuda.stream(stream):
            dst[doff:doff + n].copy_(tens[s][:n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        pending.put((ev, s))
    stream.synchronize()
    dt = time.perf_counter() - t
    pending.put(None)
    rec.join()
    for th in ths:
        th.join()
    return dt


def run_self(work, threads: int, chunk: int, per_thread: int, dst: torch.Tensor) -> float:
    """Seconds for ``threads`` threads that each read into its own ``per_thread`` pinned slots and issue the H2D
    copy of each chunk themselves on their own stream (a slot is reused after its copy's event)."""
    from vllm_fastload.streaming.hostmem import page_locked

    arena = page_locked(threads * per_thread * chunk)
    counter = itertools.count()
    dev = torch.cuda.current_device()

    def worker(k: int) -> None:
        torch.cuda.set_device(dev)
        stream = torch.cuda.Stream()
        mine = [arena[(k * per_thread + j) * chunk:(k * per_thread + j + 1) * chunk] for j in range(per_thread)]
        arrs = [x.numpy() for x in mine]
        events = [None] * per_thread
        j = 0
        while (i := next(counter)) < len(work):
            fd, off, n, doff = work[i]
            if events[j] is not None:
                events[j].synchronize()
            pread_into(fd, arrs[j][:n], off)
            with torch.cuda.stream(stream):
                dst[doff:doff + n].copy_(mine[j][:n], non_blocking=True)
                events[j] = torch.cuda.Event()
                events[j].record(stream)
            j = (j + 1) % per_thread
        stream.synchronize()

    t = time.perf_counter()
    ths = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return time.perf_counter() - t


def _cudart():
    """ctypes handle on the CUDA runtime torch loaded (ctypes calls release the GIL; torch's bindings hold it)."""
    import ctypes

    torch.cuda.init()
    with open("/proc/self/maps") as f:
        libs = sorted({line.split()[-1] for line in f if "libcudart" in line})
    if not libs:
        raise RuntimeError("libcudart is not loaded by torch")
    rt = ctypes.CDLL(libs[0])
    rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    return rt


READ_ONLY = 8  # cudaHostRegisterReadOnly ("CUDA Runtime API", cudaHostRegister): pin without write access


def run_reg(paths: list[Path], size: int, threads: int, chunk: int, copy: bool, dst: torch.Tensor) -> float:
    """Seconds to page-lock every chunk of the files' page cache in place (read-only mmap + cudaHostRegister with
    cudaHostRegisterReadOnly, no CPU copy), then (``copy``) copy it to ``dst`` and unregister after its event."""
    import mmap
    import warnings

    rt = _cudart()
    maps, bases, tens = [], [], []
    for p in paths:
        with open(p, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        maps.append(mm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.frombuffer(mm, dtype=torch.uint8)
        tens.append(t)
        bases.append(t.data_ptr())
    work = [(k, off, min(chunk, size - off), k * size + off)
            for k in range(len(paths)) for off in range(0, size, chunk)]
    done: queue.SimpleQueue = queue.SimpleQueue()
    pending: queue.SimpleQueue = queue.SimpleQueue()
    counter = itertools.count()
    errors = []
    dev = torch.cuda.current_device()

    def worker() -> None:
        torch.cuda.set_device(dev)
        while (i := next(counter)) < len(work):
            k, off, n, _ = work[i]
            rc = rt.cudaHostRegister(bases[k] + off, n, READ_ONLY)
            if rc != 0:
                errors.append(rc)
                done.put(None)
                return
            if not copy:
                rt.cudaHostUnregister(bases[k] + off)
            done.put(i)

    def recycler() -> None:
        torch.cuda.set_device(dev)
        while (item := pending.get()) is not None:
            item[0].synchronize()
            rt.cudaHostUnregister(item[1])

    stream = torch.cuda.Stream()
    t0 = time.perf_counter()
    ths = [threading.Thread(target=worker) for _ in range(threads)]
    rec = threading.Thread(target=recycler)
    rec.start()
    for th in ths:
        th.start()
    for _ in range(len(work)):
        i = done.get()
        if i is None:
            break
        if copy:
            k, off, n, doff = work[i]
            with torch.cuda.stream(stream):
                dst[doff:doff + n].copy_(tens[k][off:off + n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            pending.put((ev, bases[k] + off))
    stream.synchronize()
    dt = time.perf_counter() - t0
    pending.put(None)
    rec.join()
    for th in ths:
        th.join()
    del tens
    for mm in maps:
        try:
            mm.close()
        except BufferError:
            pass
    if errors:
        raise RuntimeError(f"cudaHostRegister(read-only) failed with CUDA error {errors[0]}")
    return dt


def h2d_peak(chunk: int = 64 * MIB, total: int = 8 << 30) -> float:
    """GB/s of back-to-back pinned H2D copies of ``chunk`` bytes (``total`` bytes in all)."""
    from vllm_fastload.streaming.hostmem import page_locked

    src = page_locked(chunk)
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    for off in range(0, total, chunk):  # warm-up
        dst[off:off + chunk].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for off in range(0, total, chunk):
        dst[off:off + chunk].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return total / (time.perf_counter() - t) / 1e9


def same_bytes(paths: list[Path], size: int, dst: torch.Tensor, samples: int = 8) -> bool:
    """Whether ``samples`` 1 MiB windows of ``dst`` (spread over every file) equal the files' bytes."""
    import numpy as np

    for j in range(samples):
        k, off = j % len(paths), (j * 7919 * MIB) % max(size - MIB, 1)
        with open(paths[k], "rb") as f:
            f.seek(off)
            want = np.frombuffer(f.read(MIB), dtype=np.uint8)
        if not np.array_equal(dst[k * size + off:k * size + off + MIB].cpu().numpy(), want):
            return False
    return True


def run_mode(mode: str, paths: list[Path], size: int, work, threads: int, chunk: int, slots: int,
             dst: torch.Tensor) -> float:
    """Seconds of one run of ``mode`` (see the module docstring)."""
    if mode in ("reg", "regcopy"):
        return run_reg(paths, size, threads, chunk, mode == "regcopy", dst)
    if mode == "self":
        return run_self(work, threads, chunk, slots, dst)
    return run_read(work, threads, chunk) if mode == "read" else run_h2d(work, threads, chunk, slots, dst)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/root/pread-probe")
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--configs", default=DEFAULT)
    a = ap.parse_args()
    total = int(a.gb * 1e9) // a.files * a.files
    t = time.perf_counter()
    paths = make_files(Path(a.dir), total, a.files)
    print(f"files: {a.files} x {total // a.files} bytes in {time.perf_counter() - t:.1f} s; "
          f"CPUs {os.cpu_count()}, kernel {os.uname().release}")
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    size = total // a.files
    run_read(chunks_of(fds, size, 16 * MIB), 16, 16 * MIB)  # make sure every page is resident
    print(f"pinned H2D alone: {h2d_peak():.1f} GB/s\n")
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    print("| mode | threads | chunk MiB | slots | s (best) | s (median) | GB/s (best) |\n|---|---|---|---|---|---|---|")
    for c in a.configs.split(","):
        mode, threads, chunk_mib, slots = c.split(":")
        threads, chunk, slots = int(threads), int(chunk_mib) * MIB, int(slots)
        work = chunks_of(fds, size, chunk)
        try:
            runs = sorted(run_mode(mode, paths, size, work, threads, chunk, slots, dst) for _ in range(a.repeat))
            best, median = runs[0], runs[len(runs) // 2]
        except RuntimeError as e:
            print(f"| {mode} | {threads} | {chunk_mib} | {slots or '-'} | {e} | |", flush=True)
            continue
        ok = "" if mode in ("read", "reg") else (" (bytes ok)" if same_bytes(paths, size, dst) else " (BYTES DIFFER)")
        print(f"| {mode} | {threads} | {chunk_mib} | {slots or '-'} | {best:.3f} | {median:.3f} | "
              f"{total / best / 1e9:.1f}{ok} |", flush=True)
        dst.zero_()
    for fd in fds:
        os.close(fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
