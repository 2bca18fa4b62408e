"""Per-tensor cost (us) of the ways ``ipc_cache`` can make a mapped tensor over a flat segment, on CPU and CUDA.

N tensors of 4 KiB each laid out in one flat ``uint8`` buffer viewed as bf16: ``as_strided`` on the typed view
(what ``layout.views`` does), the same plus ``detach`` (what install keeps), ``as_strided`` below autograd (no view
tracking, so no ``detach`` needed), and ``torch.empty(0).set_(storage, ...)``. Also whether each result is an
autograd view (``_is_view``). Usage: ``python3 benchmarks/view_probe.py [--n 40000]``.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch


def bench(fn, n: int, reps: int = 5) -> float:
    """Best microseconds per tensor of ``fn(i)`` for i < n."""
    best = float("inf")
    for _ in range(reps):
        gc.collect()
        gc.disable()
        t = time.perf_counter()
        out = [fn(i) for i in range(n)]
        best = min(best, time.perf_counter() - t)
        gc.enable()
        del out
    return best / n * 1e6


def row(dev: str, n: int) -> str:
    """The table row of device ``dev``."""
    buf = torch.zeros(n * 4096, dtype=torch.uint8, device=dev)
    typed = buf.view(torch.bfloat16)
    st = typed.untyped_storage()
    strided = typed.as_strided
    shape, stride = (32, 64), (64, 1)
    guard = torch._C._AutoDispatchBelowADInplaceOrView

    def plain(i):
        return strided(shape, stride, i * 2048)

    def detached(i):
        return strided(shape, stride, i * 2048).detach()

    def below(i):
        with guard():
            return strided(shape, stride, i * 2048)

    def set_(i):
        return torch.empty(0, dtype=torch.bfloat16, device=dev).set_(st, i * 2048, shape, stride)

    a, b, c, d = (bench(f, n) for f in (plain, detached, below, set_))
    # the guard once around the whole loop, as a real loop would take it
    t = time.perf_counter()
    with guard():
        got = [strided(shape, stride, i * 2048) for i in range(n)]
    c2 = (time.perf_counter() - t) / n * 1e6
    return (f"| {dev} | {a:.2f} | {b:.2f} | {c:.2f} (guard per call), {c2:.2f} (one guard) | {d:.2f} | "
            f"{plain(1)._is_view()} / {got[1]._is_view()} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40000)
    n = ap.parse_args().n
    print("| device | as_strided | + detach | below autograd | empty().set_ | is view: strided / below |")
    print("|---|---|---|---|---|---|")
    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        print(row(dev, n))


if __name__ == "__main__":
    main()
