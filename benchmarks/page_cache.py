"""Cold page cache for the benchmarks: drop a checkpoint's pages from the page cache, and measure the disk's own
read speed, the limit a cold load is held to (issue 28: "the cold page cache stays at the disk's limit").

    python benchmarks/page_cache.py DIR [--threads 1,4,16]    # evict DIR's shards, then the disk's O_DIRECT GB/s

:func:`evict` uses ``posix_fadvise(POSIX_FADV_DONTNEED)`` (posix_fadvise(2): the kernel drops the file's clean pages
that no process maps; no root needed, unlike ``/proc/sys/vm/drop_caches``) and reports what stayed resident with
this package's own ``mincore`` sampler (:func:`vllm_fastload.storage.page_cache_fraction`). :func:`disk_gbps`
reads the files with ``O_DIRECT`` (past the page cache) from several threads at once, as a cold load's reader does
(``os.preadv`` releases the GIL), into page-aligned buffers (``O_DIRECT`` needs aligned memory and offsets).
"""

from __future__ import annotations

import argparse
import collections
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

#: bytes per O_DIRECT read (a multiple of every block size in use; the readers' own request size)
BLOCK = 8 * 2**20


def evict(paths: list[str]) -> Optional[float]:
    """Drop ``paths``' pages from the page cache; returns the fraction (0..1) still resident after it (None where
    ``mincore`` cannot tell). Pages a process maps or that are dirty stay: a fraction well above 0 says so."""
    from vllm_fastload.storage import page_cache_fraction

    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # a file just written (make_model) may still have dirty pages, which DONTNEED keeps
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return page_cache_fraction(list(paths))


def disk_gbps(paths: list[str], threads: int, block: int = BLOCK) -> float:
    """GB/s (1e9 bytes per second) of reading every byte of ``paths`` with ``O_DIRECT`` from ``threads`` threads,
    each taking the next ``block``-byte range, file by file from the start. Evict first: ``O_DIRECT`` skips the page
    cache on most file systems, but some (tmpfs, some overlay and FUSE mounts) refuse it: ``OSError`` (EINVAL) is
    raised then, as is any worker's error."""
    ranges = collections.deque((p, off) for p in paths for off in range(0, os.path.getsize(p), block))
    lock, total, errors = threading.Lock(), [0], []
    fds: dict[str, int] = {}

    def work() -> None:
        buf = mmap.mmap(-1, block)  # page-aligned
        try:
            while True:
                with lock:
                    if not ranges or errors:
                        return
                    p, off = ranges.popleft()
                n = os.preadv(fds[p], [buf], off)
                with lock:
                    total[0] += n
        except BaseException as e:  # noqa: BLE001 - raised in the calling thread below
            errors.append(e)
        finally:
            buf.close()

    pool: list[threading.Thread] = []
    try:
        for p in paths:
            fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECT)
        t = time.perf_counter()
        for _ in range(threads):
            pool.append(threading.Thread(target=work))
            pool[-1].start()
    finally:
        for th in pool:
            th.join()
        for fd in fds.values():
            os.close(fd)
    if errors:
        raise errors[0]
    return total[0] / (time.perf_counter() - t) / 1e9


def disk_limit(paths: list[str], threads: tuple[int, ...] = (1, 4, 16)) -> dict:
    """``{"gbps": best, "by_threads": {n: GB/s}}``: :func:`disk_gbps` after an eviction, for each thread count;
    ``{"gbps": None, "error": why}`` where the file system refuses ``O_DIRECT`` (the eviction itself still works)."""
    by = {}
    try:
        for n in threads:
            evict(paths)
            by[n] = round(disk_gbps(paths, n), 2)
    except OSError as e:
        return {"gbps": None, "error": f"O_DIRECT reads refused ({e}); the disk's limit is not known here"}
    return {"gbps": max(by.values()), "by_threads": by}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", default="1,4,16")
    a = ap.parse_args()
    files = [str(f) for f in sorted(a.model.glob("*.safetensors"))]
    print(f"resident after eviction: {evict(files)}")
    print(disk_limit(files, tuple(int(x) for x in a.threads.split(","))))
