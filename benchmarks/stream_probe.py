"""The direct read path alone on a GPU, without vLLM: read-path candidates compared in one process, in rounds.

    PYTHONPATH=src python3 benchmarks/stream_probe.py --model DIR [--make 8b] [--variants torch,driver] [--rounds 5]

Streams every tensor of the checkpoint in DIR (``--make SHAPE`` writes it first with ``make_model.py`` when DIR has
no shards) through :func:`vllm_fastload.streaming.direct.stream_to_device`, the loader's direct path, with this
package's io_uring reader (8 MiB slots, 16 reads in flight, the loading thread pinned as by default), and copies
each tensor into a parameter allocated beforehand on the consumer's stream (what vLLM's default ``weight_loader``
does with it). Seconds per load from the first read to the last parameter's copy finished, the pinned arena
allocated before (the loader allocates it beside model construction); the page cache is warmed by one untimed load.
Variants, interleaved round by round so that a drift of the machine falls on each alike: ``torch`` (the default:
PyTorch's ``copy_`` and events), ``driver`` (``FASTLOAD_H2D_DRIVER``: streaming/cudriver.py), ``torch24`` /
``driver24`` (24 slots, 16 reads in flight). Needs torch with CUDA, safetensors (``--make``) and the ``liburing``
package; not vLLM nor runai-model-streamer. It screens a candidate cheaply; the numbers issue 28 is judged by are
vLLM's weights phase in engines (``load_bench.py``), which adds vLLM's own per-tensor work. Prints Markdown; with
``--out FILE`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from load_bench import h2d_bandwidth
from make_model import SHAPES, make

from vllm_fastload.checkpoint import read_header
from vllm_fastload.errors import CheckpointError
from vllm_fastload.streaming import cudriver, direct
from vllm_fastload.streaming.timing import StageTimes

MIB = 1 << 20
#: variant -> (driver path on, ring slots, page cache: None, "inline" or "early"); every ring variant keeps 16
#: reads of 8 MiB in flight. ``pagecache``: the copies read the page cache itself (streaming/pagecache.py), its
#: registration inside the timed load; ``pagecache-early``: registration started EARLY_S before the timed load, as
#: the loader starts it beside vLLM's model construction (which this probe does not run)
VARIANTS = {"torch": (False, 16, None), "driver": (True, 16, None), "torch24": (False, 24, None),
            "driver24": (True, 24, None), "pagecache": (False, 16, "inline"), "pagecache-early": (False, 16, "early")}
#: seconds the early registration gets before the timed load (vLLM's construction of the 8B shape: 0.23-0.35 s)
EARLY_S = 0.3


def load_once(headers: list, params: dict, variant: str, arena: torch.Tensor) -> dict:
    """One load of every tensor of ``headers`` into ``params`` (name -> CUDA tensor) under ``variant``; its wall
    seconds and stage times."""
    driver, slots, pagecache_mode = VARIANTS[variant]
    cudriver.ENABLED = driver
    ring = direct.Ring(8 * MIB, slots, 16, uring=True, pagecache=pagecache_mode is not None)
    times, stats = StageTimes(), {}
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    if pagecache_mode == "early":
        from vllm_fastload.streaming import pagecache

        pagecache.start_early([h.path for h in headers], device.index)
        time.sleep(EARLY_S)
    t0 = time.perf_counter()
    first = None
    for name, t in direct.stream_to_device(headers, device, ring, times, arena, stats):
        params[name].copy_(t)
        if first is None:
            first = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"variant": variant, "wall_s": wall, "first_tensor_s": first, "read_wait_s": times.read_wait_s,
            "pagecache_register_s": stats.get("pagecache_register_s"),
            "h2d_s": times.h2d_s, "driver_copies": times.driver_copies or 0, "bytes": times.bytes,
            "loader_cpu": stats.get("uring_loader_cpu")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--make", default=None, choices=sorted(SHAPES),
                    help="make_model.py shape to write into --model when it has no shards")
    ap.add_argument("--variants", default="torch,driver")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (>= 1)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")
    if args.rounds < 1:
        sys.exit(f"--rounds: {args.rounds}; give 1 or more")
    if args.out is not None and not args.out.parent.is_dir():
        sys.exit(f"--out {args.out}: its folder does not exist")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device here: the probe copies to a GPU (run it on the device machine, "
                 "bash benchmarks/device.sh streamprobe)")
    from vllm_fastload.streaming.uring import unavailable

    if unavailable():
        sys.exit(f"no io_uring reader here: {unavailable()}")
    if args.model.exists() and not args.model.is_dir():
        sys.exit(f"--model {args.model}: not a folder")
    shards = sorted(p for p in args.model.glob("*.safetensors") if p.is_file())
    if not shards and args.make:
        make(args.model, args.make)
        shards = sorted(args.model.glob("*.safetensors"))
    if not shards:
        sys.exit(f"--model {args.model}: " + ("no such folder" if not args.model.exists() else "no *.safetensors")
                 + " (pass --make SHAPE to write one)")
    try:
        headers = [read_header(str(p)) for p in shards]
    except CheckpointError as e:
        sys.exit(f"--model {args.model}: {e}")
    dtypes = direct.torch_dtypes()
    params = {t.name: torch.empty(t.shape, dtype=dtypes[t.dtype], device="cuda")
              for h in headers for t in h.tensors.values()}
    arenas = {slots: direct.allocate_arena(8 * MIB, slots) for slots in {VARIANTS[v][1] for v in variants}}
    load_once(headers, params, variants[0], arenas[VARIANTS[variants[0]][1]])  # warms the page cache
    rows = []
    for _ in range(args.rounds):
        for v in variants:
            rows.append(load_once(headers, params, v, arenas[VARIANTS[v][1]]))
            if VARIANTS[v][2]:
                time.sleep(0.5)  # the page cache is unregistered on a thread after the load: not beside the next
    gbs = h2d_bandwidth()["pinned_h2d_gbps"]  # the link alone, as load_bench.py measures it
    total = rows[0]["bytes"]
    print(f"{total / 1e9:.2f} GB in {sum(len(h.tensors) for h in headers)} tensors; pinned H2D of 1 GiB "
          f"{gbs:.1f} GB/s; {args.rounds} interleaved rounds")
    print("| variant | wall s, each round | median s | GB/s (median) | first tensor s | read wait s | H2D GPU s "
          "| driver copies |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        walls = [r["wall_s"] for r in mine]
        med = statistics.median(walls)
        print(f"| {v} | {', '.join(f'{w:.3f}' for w in walls)} | {med:.3f} | {total / med / 1e9:.1f} "
              f"| {statistics.median(r['first_tensor_s'] for r in mine):.3f} "
              f"| {statistics.median(r['read_wait_s'] for r in mine):.3f} "
              f"| {statistics.median(r['h2d_s'] for r in mine):.3f} | {mine[-1]['driver_copies']} |")
    if args.out:
        args.out.write_text(json.dumps({"pinned_h2d_gbs": gbs, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
