"""Does page-locking the read arena on a thread really overlap vLLM's model construction?

Measures on one GPU (seconds): building 8B-shaped parameters with ``torch.empty(..., device="cuda")`` (what model
construction allocates), page-locking 1 GiB with PyTorch's pinned allocator (``cudaHostAlloc``), both at once
(pinning on a thread, as ``streaming.direct.ArenaFuture`` does), and ``cudaHostRegister`` of an anonymous mapping
with and without ``MADV_HUGEPAGE``, and this package's ``streaming.hostmem.page_locked`` alone and on a thread
during construction. Prints a Markdown table. Usage: ``PYTHONPATH=src python3 benchmarks/pin_probe.py``.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

import torch

GIB = 1 << 30


def sizes_8b() -> list[int]:
    """Bytes of each bf16 parameter of a Llama-3-8B-shaped vLLM model (fused qkv and gate_up), 195 tensors, 16.06 GB."""
    h, kv, inter, vocab = 4096, 1024, 14336, 128256
    per_layer = [(h + 2 * kv) * h, h * h, 2 * inter * h, h * inter, h, h]
    return [2 * n for n in [vocab * h] + per_layer * 32 + [h, vocab * h]]


def _timed(make, drop) -> float:
    """Seconds of ``make()``; its result is then passed to ``drop`` (not timed)."""
    t = time.perf_counter()
    x = make()
    dt = time.perf_counter() - t
    drop(x)
    return dt


def construct() -> float:
    """Seconds to allocate the 8B-shaped parameters on the GPU (what vLLM's model construction allocates)."""
    def make():
        ts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes_8b()]
        torch.cuda.synchronize()
        return ts

    return _timed(make, lambda ts: (ts.clear(), torch.cuda.empty_cache()))


def pin_torch(n: int = GIB) -> float:
    """Seconds of PyTorch's pinned allocator (``cudaHostAlloc``) for ``n`` bytes."""
    return _timed(lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True), lambda x: torch._C._host_emptyCache())


def pin_ours(n: int = GIB) -> float:
    """Seconds of :func:`vllm_fastload.streaming.hostmem.page_locked` (what the read arena uses now)."""
    import gc

    from vllm_fastload.streaming.hostmem import page_locked

    def make():
        x = page_locked(n)
        assert x.is_pinned()
        return [x]

    return _timed(make, lambda box: (box.clear(), gc.collect()))


def beside(pin) -> tuple[float, float]:
    """(construction seconds, ``pin()`` seconds) with ``pin`` running on a thread during the construction."""
    box = {}
    th = threading.Thread(target=lambda: box.update(pin=pin()))
    th.start()
    c = construct()
    th.join()
    return c, box["pin"]


def pin_register(n: int = GIB, huge: bool = False) -> tuple[float, float]:
    """(seconds to fault the pages in, seconds for cudaHostRegister) of an anonymous mapping."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(m, "madvise"):
        m.madvise(mmap.MADV_HUGEPAGE)
    buf = (ctypes.c_char * n).from_buffer(m)
    ptr = ctypes.addressof(buf)
    t = time.perf_counter()
    ctypes.memset(ptr, 0, n)  # fault in
    t_fault = time.perf_counter() - t
    rt = torch.cuda.cudart()
    t = time.perf_counter()
    rc = rt.cudaHostRegister(ptr, n, 0)
    t_reg = time.perf_counter() - t
    assert int(rc) == 0, f"cudaHostRegister failed: {rc}"
    rt.cudaHostUnregister(ptr)
    del buf
    m.close()
    return t_fault, t_reg


def main() -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    construct()  # warm the allocator paths once
    rows = []
    for _ in range(3):
        rows.append(("construct alone", construct()))
        rows.append(("pin 1 GiB alone (torch pinned allocator)", pin_torch()))
        c, p = beside(pin_torch)
        rows += [("construct while pinning on a thread", c), ("  the pinning meanwhile", p)]
        rows.append(("page_locked() 1 GiB alone (streaming.hostmem: huge pages, faulted in, registered)",
                     pin_ours()))
        c, p = beside(pin_ours)
        rows += [("construct while page_locked() runs on a thread", c), ("  page_locked() meanwhile", p)]
        f, r = pin_register(huge=False)
        rows.append(("mmap 1 GiB: fault in / cudaHostRegister", f"{f:.3f} / {r:.3f}"))
        f, r = pin_register(huge=True)
        rows.append(("mmap 1 GiB + MADV_HUGEPAGE: fault in / cudaHostRegister", f"{f:.3f} / {r:.3f}"))
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = "?"
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, THP: {thp}\n")
    print("| measurement | seconds |\n|---|---|")
    for name, v in rows:
        print(f"| {name} | {v if isinstance(v, str) else f'{v:.3f}'} |")


if __name__ == "__main__":
    main()
