"""Copies straight out of the page cache: the checkpoint's pages registered with CUDA, no read into a ring.

    PYTHONPATH=src python3 benchmarks/pagecache_probe.py --model DIR [--make 8b] [--chunk-mib 256]
                                                         [--threads 1,4,8] [--rounds 3] [--out FILE]

A question for issue 28's TP=1 read path, without vLLM: on a warm page cache, every reader so far (ours, io_uring
into an 8 MiB pinned ring; instanttensor's) copies each byte twice, once by a CPU from the page cache into pinned
memory and once by the copy engine from there to the GPU, and the two share the host's memory. Here each shard is
mapped read-only (``mmap``, ``MAP_SHARED``) and its pages are page-locked where they are with ``cudaHostRegister``
(flag ``cudaHostRegisterReadOnly``, CUDA 11.1+: "the memory will be considered as read-only by the device", CUDA
Runtime API), in chunks of ``--chunk-mib`` on ``--threads`` threads; then each tensor is one ``copy_`` from the
mapping into a CUDA buffer allocated before (split where a chunk ends). Per round and thread count:

- ``seq``: every chunk registered, then every copy: ``reg_s``, ``copy_s`` and their sum;
- ``pipe``: the copies issued as the chunks they need are registered, the registrations on the threads:
  ``wall_s`` from the first registration to the last copy finished;
- ``-populate``: the same with every page of a chunk mapped first (``madvise(MADV_POPULATE_READ)``) by the
  registering thread, so the registration finds the page table filled.

Each round maps the shards anew (a loading process starts with no page table for them) and unregisters and unmaps
them after (``unreg_s``). With the ``liburing`` package importable, the direct path of ``stream_probe.py``
(``torch``: 8 MiB x 16 in flight, what the loader does) runs in the same rounds, as the baseline. Bytes are
checked: the last round compares the copied buffer with the shards' bytes (read through the page cache).
Prints Markdown; ``--out`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import json
import mmap
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from load_bench import h2d_bandwidth
from make_model import SHAPES, make

from vllm_fastload.checkpoint import read_header
from vllm_fastload.errors import CheckpointError

MIB = 1 << 20
PAGE = mmap.PAGESIZE
#: cudaHostRegisterReadOnly (CUDA Runtime API, cudaHostRegister's flags)
READ_ONLY = 0x08


#: madvise(MADV_POPULATE_READ) (Linux 5.14): map every page of a range now, in one call
MADV_POPULATE_READ = 22
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _register(ptr: int, nbytes: int, device: int, flags: int, populate: bool = False) -> tuple[int, float]:
    """``cudaHostRegister(ptr, nbytes, flags)`` with ``device`` current, after ``MADV_POPULATE_READ`` of the range
    with ``populate``; (CUDA error code, seconds)."""
    torch.cuda.set_device(device)
    t = time.perf_counter()
    if populate:
        start = ptr - ptr % PAGE
        if _LIBC.madvise(start, ptr + nbytes - start, MADV_POPULATE_READ):
            return -ctypes.get_errno(), time.perf_counter() - t
    rc = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags))
    return rc, time.perf_counter() - t


def _unregister(ptr: int, device: int) -> int:
    torch.cuda.set_device(device)
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


class Mapped:
    """The shards mapped read-only, as flat uint8 CPU tensors over the mappings; ``chunks``: (shard index, start,
    end) byte ranges of ``chunk`` bytes (page-aligned starts) covering each whole mapping."""

    def __init__(self, shards: list[Path], chunk: int):
        self.maps, self.hosts, self.chunks = [], [], []
        for i, p in enumerate(shards):
            with open(p, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():  # read-only on purpose: the device only reads it
                warnings.simplefilter("ignore")
                self.hosts.append(torch.frombuffer(mm, dtype=torch.uint8))
            self.maps.append(mm)
            size = len(mm)
            self.chunks += [(i, a, min(a + chunk, size)) for a in range(0, size, chunk)]

    def ptr(self, i: int, a: int) -> int:
        return self.hosts[i].data_ptr() + a

    def close(self) -> None:
        self.hosts.clear()
        for mm in self.maps:
            mm.close()
        self.maps.clear()


def pieces(headers: list, chunk: int) -> list[tuple[int, int, int, int]]:
    """(shard index, file offset, bytes, destination offset) of every tensor's bytes, split where a chunk ends,
    in file order; destinations packed one after another."""
    out, dst = [], 0
    for i, h in enumerate(headers):
        for t in sorted(h.tensors.values(), key=lambda t: t.begin):
            a, n = 8 + h.header_len + t.begin, t.nbytes
            while n:
                take = min(n, chunk - a % chunk)
                out.append((i, a, take, dst))
                a, n, dst = a + take, n - take, dst + take
    return out


def load_once(shards: list[Path], headers: list, dst: torch.Tensor, mode: str, threads: int, chunk: int,
              flags: int, populate: bool = False) -> dict:
    """One load of every tensor into ``dst`` from page-locked mappings; seconds of each step."""
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m = Mapped(shards, chunk)
    t_map = time.perf_counter() - t0
    plan = pieces(headers, chunk)
    registered: list[tuple[int, int]] = []
    copy_s = reg_s = None
    with cf.ThreadPoolExecutor(threads) as pool:
        t1 = time.perf_counter()
        futs = {(i, a): pool.submit(_register, m.ptr(i, a), b - a, device, flags, populate)
                for i, a, b in m.chunks}
        if mode == "seq":
            for (i, a), f in futs.items():
                rc, _ = f.result()
                if rc:
                    raise RuntimeError(f"cudaHostRegister of shard {i} at {a}: CUDA error {rc}")
                registered.append((i, a))
            reg_s = time.perf_counter() - t1
            t2 = time.perf_counter()
        for i, a, n, d in plan:
            key = (i, a - a % chunk)
            if mode == "pipe":
                rc, _ = futs[key].result()
                if rc:
                    raise RuntimeError(f"cudaHostRegister of shard {i} at {key[1]}: CUDA error {rc}")
            dst[d:d + n].copy_(m.hosts[i][a:a + n], non_blocking=True)
        torch.cuda.synchronize()
        end = time.perf_counter()
        if mode == "seq":
            copy_s = end - t2
        else:
            registered = [k for k, f in futs.items() if f.result()[0] == 0]
    wall = end - t1
    t3 = time.perf_counter()
    bad = [rc for i, a in registered if (rc := _unregister(m.ptr(i, a), device))]
    m.close()
    unreg = time.perf_counter() - t3
    if bad:
        raise RuntimeError(f"cudaHostUnregister failed: CUDA errors {sorted(set(bad))}")
    return {"variant": f"{mode}{threads}" + ("-populate" if populate else ""), "map_s": t_map, "reg_s": reg_s,
            "copy_s": copy_s, "wall_s": wall,
            "unreg_s": unreg, "bytes": sum(n for _, _, n, _ in plan)}


def check_bytes(shards: list[Path], headers: list, dst: torch.Tensor, chunk: int) -> int:
    """Compare ``dst`` with the shards' tensor bytes; returns how many pieces differ."""
    host = dst.cpu()
    bad = 0
    files = [open(p, "rb") for p in shards]
    try:
        for i, a, n, d in pieces(headers, chunk):
            files[i].seek(a)
            if files[i].read(n) != host[d:d + n].numpy().tobytes():
                bad += 1
    finally:
        for f in files:
            f.close()
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--make", default=None, choices=sorted(SHAPES))
    ap.add_argument("--chunk-mib", type=int, default=256)
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flags", type=lambda s: int(s, 0), default=READ_ONLY,
                    help="cudaHostRegister flags (default 0x08, cudaHostRegisterReadOnly)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if a.rounds < 1 or a.chunk_mib < 1 or (a.chunk_mib * MIB) % PAGE:
        sys.exit("--rounds >= 1 and --chunk-mib >= 1 (a whole number of pages)")
    threads = [int(x) for x in a.threads.split(",")]
    if not torch.cuda.is_available():
        sys.exit("no CUDA device here")
    shards = sorted(p for p in a.model.glob("*.safetensors") if p.is_file()) if a.model.is_dir() else []
    if not shards and a.make:
        make(a.model, a.make)
        shards = sorted(a.model.glob("*.safetensors"))
    if not shards:
        sys.exit(f"--model {a.model}: no *.safetensors (pass --make SHAPE)")
    try:
        headers = [read_header(str(p)) for p in shards]
    except CheckpointError as e:
        sys.exit(f"--model {a.model}: {e}")
    chunk = a.chunk_mib * MIB
    total = sum(n for _, _, n, _ in pieces(headers, chunk))
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    for p in shards:  # warm the page cache
        with open(p, "rb") as f:
            while f.read(64 * MIB):
                pass
    baseline = None
    try:
        from vllm_fastload.streaming.uring import unavailable

        if unavailable() is None:
            import stream_probe

            from vllm_fastload.streaming import direct

            dtypes = direct.torch_dtypes()
            params = {t.name: torch.empty(t.shape, dtype=dtypes[t.dtype], device="cuda")
                      for h in headers for t in h.tensors.values()}
            arena = direct.allocate_arena(8 * MIB, 16)
            baseline = lambda: stream_probe.load_once(headers, params, "torch", arena)  # noqa: E731
    except ImportError as e:
        print(f"no baseline: {e}")
    variants = ([("seq", t, False) for t in threads] + [("pipe", t, False) for t in threads]
                + [("seq", threads[-1], True), ("pipe", threads[-1], True)])
    rows = []
    try:
        load_once(shards, headers, dst, "seq", threads[-1], chunk, a.flags)  # first touch of the driver path
    except RuntimeError as e:
        sys.exit(f"page-cache registration refused with flags {a.flags:#x}: {e}")
    for _ in range(a.rounds):
        if baseline is not None:
            r = baseline()
            rows.append({"variant": "ours (io_uring ring)", "wall_s": r["wall_s"], "bytes": r["bytes"]})
        for mode, th, pop in variants:
            rows.append(load_once(shards, headers, dst, mode, th, chunk, a.flags, pop))
    bad = check_bytes(shards, headers, dst, chunk)
    gbs = h2d_bandwidth()["pinned_h2d_gbps"]
    print(f"{total / 1e9:.2f} GB, {len(pieces(headers, chunk))} copies; chunks of {a.chunk_mib} MiB; flags "
          f"{a.flags:#x}; pinned H2D of 1 GiB {gbs:.1f} GB/s; {a.rounds} rounds; bytes differ in {bad} copies")
    print("| variant | wall s, each round | median s | GB/s | map s | register s | copy s (GB/s) | unregister s |")
    print("|---|---|---|---|---|---|---|---|")
    names = ["ours (io_uring ring)"] * (baseline is not None) + [f"{m}{t}" + ("-populate" if p else "")
                                                                  for m, t, p in variants]
    for v in names:
        mine = [r for r in rows if r["variant"] == v]
        walls = [r["wall_s"] for r in mine]
        med = statistics.median(walls)

        def md(key: str, mine: list = mine) -> str:
            vals = [r[key] for r in mine if r.get(key) is not None]
            return f"{statistics.median(vals):.3f}" if vals else "-"

        cp = [r["copy_s"] for r in mine if r.get("copy_s")]
        cps = f"{statistics.median(cp):.3f} ({total / statistics.median(cp) / 1e9:.1f})" if cp else "-"
        print(f"| {v} | {', '.join(f'{w:.3f}' for w in walls)} | {med:.3f} | {total / med / 1e9:.1f} | {md('map_s')} "
              f"| {md('reg_s')} | {cps} | {md('unreg_s')} |")
    if a.out:
        a.out.write_text(json.dumps({"pinned_h2d_gbs": gbs, "bytes_differ": bad, "rows": rows}, indent=2))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
