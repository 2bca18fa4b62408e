"""Compare model loaders, each in a fresh process, on one machine, in one run.

    python benchmarks/load_bench.py --model DIR [--make 8b|tiny] [--tp 1] [--out docs/bench]
           [--loaders auto,runai_builtin,runai_fastload]

For each loader a fresh Python process builds ``vllm.LLM(model, load_format=..., enforce_eager=True,
skip_tokenizer_init=True)``, generates 8 greedy tokens and exits. We parse vLLM's "Model loading took ... and X
seconds" (GPU) and "Loading weights took X seconds" (default loader) lines and our load report, and time the
whole ``LLM()`` construction. ``runai_builtin`` is vLLM's own runai loader: our plugin is disabled for that
process with ``VLLM_PLUGINS=`` (empty). On a GPU the run also measures pinned and pageable H2D bandwidth.
Writes ``results.json``, ``results.md`` (a Markdown table) and ``results.png`` (a bar chart) under ``--out``, and
appends every run to ``runs.jsonl`` there as it ends (what a call cut short still has).
Page cache: warmed once, every shard read, before the first loader (``--cold``: dropped before every run instead).
Each loader runs ``--repeats`` times, one after another or (``--interleave``) in rounds of one run per loader; the
median run by "Model loading took" is reported, with every run's weights phase.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: io-wq workers of the runai_fastload_uringw loaders: all CPUs but two
IOWQ_WORKERS = str(max(1, (os.cpu_count() or 3) - 2))
LOADERS = {
    "auto": ("auto", {}),
    "runai_builtin": ("runai_streamer", {"VLLM_PLUGINS": ""}),
    "runai_fastload": ("runai_streamer", {}),
    # ours with `pinned_reader: false`: runai reads into pageable memory, tensors are copied through a pinned ring
    "runai_fastload_ring": ("runai_streamer", {}),
    # ours with `content_hash: true`: every tensor's bytes hashed (BLAKE3) while loading
    "runai_fastload_hashed": ("runai_streamer", {}),
    # ours with runai reading the page cache (`fs_strategy: sync_buffered`) instead of our pread reader, with the
    # default slots and with the slots of before the pread reader (32 MiB)
    "runai_fastload_runai": ("runai_streamer", {}),
    "runai_fastload_runai32": ("runai_streamer", {}),
    # ours with the H2D copies issued by a thread of the load (`issue_thread: true`)
    "runai_fastload_issue": ("runai_streamer", {}),
    # ours with this package's io_uring reader (`fs_strategy: uring_buffered`) instead of the pread threads
    "runai_fastload_uring": ("runai_streamer", {}),
    # the same with other read request sizes (FASTLOAD_URING_PART_BYTES) and requests in flight (`concurrency`)
    "runai_fastload_uring8m16": ("runai_streamer", {"FASTLOAD_URING_PART_BYTES": str(8 << 20)}),
    "runai_fastload_uring2m32": ("runai_streamer", {"FASTLOAD_URING_PART_BYTES": str(2 << 20)}),
    "runai_fastload_uring1m48": ("runai_streamer", {"FASTLOAD_URING_PART_BYTES": str(1 << 20)}),
    "runai_fastload_uring12": ("runai_streamer", {}),  # 12 slots (a 96 MiB ring), all in flight
    "runai_fastload_uring24": ("runai_streamer", {}),  # 24 slots, all in flight
    "runai_fastload_uring48": ("runai_streamer", {}),  # 48 slots, all in flight
    # 16 MiB slots and read requests, 16 in flight
    "runai_fastload_uring16m": ("runai_streamer", {"FASTLOAD_URING_PART_BYTES": str(16 << 20)}),
    # the io_uring reader with every H2D copy on a timeline (FASTLOAD_H2D_TIMELINE, streaming/timeline.py): where
    # the copy engine stood idle and why; the timeline lands beside the report, its account in the results
    "runai_fastload_uringtl": ("runai_streamer", {}),
    # the io_uring reader with at most CPUs - 2 io-wq workers copying (FASTLOAD_URING_IOWQ_WORKERS), leaving the
    # loading thread a CPU to issue copies from (docs/benchmarks.md, the H2D timeline), and the same on a timeline
    "runai_fastload_uringw": ("runai_streamer", {"FASTLOAD_URING_IOWQ_WORKERS": IOWQ_WORKERS}),
    "runai_fastload_uringwtl": ("runai_streamer", {"FASTLOAD_URING_IOWQ_WORKERS": IOWQ_WORKERS}),
    # the io_uring reader with an event after every second copy instead of each (FASTLOAD_H2D_EVENT_EVERY=2): fewer
    # driver calls on the loading thread; both candidates together in uringwe2
    "runai_fastload_uringe2": ("runai_streamer", {"FASTLOAD_H2D_EVENT_EVERY": "2"}),
    "runai_fastload_uringwe2": ("runai_streamer", {"FASTLOAD_H2D_EVENT_EVERY": "2",
                                                   "FASTLOAD_URING_IOWQ_WORKERS": IOWQ_WORKERS}),
    # the io_uring reader with the loading thread on a CPU of its own and the io-wq workers on the others
    # (FASTLOAD_URING_IOWQ_AFF=1, also on hosts below uring.AFFINITY_MIN_CPUS); with an event per two copies as
    # well; and without it (=0: the reader as before the pin became the default on hosts of >= 8 CPUs)
    "runai_fastload_uringa": ("runai_streamer", {"FASTLOAD_URING_IOWQ_AFF": "1"}),
    "runai_fastload_uringae2": ("runai_streamer", {"FASTLOAD_URING_IOWQ_AFF": "1", "FASTLOAD_H2D_EVENT_EVERY": "2"}),
    "runai_fastload_uringnoa": ("runai_streamer", {"FASTLOAD_URING_IOWQ_AFF": "0"}),
    # ours reading beside model construction (`prefetch: true`), with the interpreter's switch interval lowered
    # while it runs (the default, streaming/prefetch.py) and left at Python's 5 ms (FASTLOAD_PREFETCH_SWITCH_US)
    "runai_fastload_prefetch": ("runai_streamer", {}),
    "runai_fastload_prefetchsw5ms": ("runai_streamer", {"FASTLOAD_PREFETCH_SWITCH_US": "5000"}),
    "runai_fastload_prefetchsw1ms": ("runai_streamer", {"FASTLOAD_PREFETCH_SWITCH_US": "1000"}),
    # the same with 32 MiB slots (4 read requests each): a quarter of the copies to issue, under the GIL
    "runai_fastload_prefetch32m": ("runai_streamer", {}),
    "runai_fastload_prefetch32msw1ms": ("runai_streamer", {"FASTLOAD_PREFETCH_SWITCH_US": "1000"}),
    "runai_fastload_uring32m": ("runai_streamer", {}),
    "runai_fastload_prefetch64m": ("runai_streamer", {}),  # 64 MiB slots (8 read requests each)
    # the prefetch leaving the constructing thread CPUs: at most 4 io-wq workers (FASTLOAD_URING_IOWQ_WORKERS), or 4
    # reads in flight (`concurrency: 4`); not yet run (docs/benchmarks.md, TP=1, reading beside construction)
    "runai_fastload_prefetchw4": ("runai_streamer", {"FASTLOAD_URING_IOWQ_WORKERS": "4"}),
    "runai_fastload_prefetchc4": ("runai_streamer", {}),
    # the io_uring reader with the untimed H2D copies and their events issued through the CUDA driver API
    # (FASTLOAD_H2D_DRIVER=1, streaming/cudriver.py) instead of PyTorch; and the same on the copy-issue thread
    "runai_fastload_uringdrv": ("runai_streamer", {"FASTLOAD_H2D_DRIVER": "1"}),
    "runai_fastload_issuedrv": ("runai_streamer", {"FASTLOAD_H2D_DRIVER": "1"}),
    # the driver path with 24 slots and 16 reads in flight: up to 8 slots hold pieces whose copies are queued, so
    # the copy engine has work queued while the loading thread is in vLLM's weight_loader
    "runai_fastload_uringdrv24": ("runai_streamer", {"FASTLOAD_H2D_DRIVER": "1"}),
    # the copies reading the page cache itself (its pages page-locked in place, one registration per shard,
    # started beside model construction: streaming/pagecache.py; FASTLOAD_PAGECACHE_DMA=1)
    "runai_fastload_pcdma": ("runai_streamer", {"FASTLOAD_PAGECACHE_DMA": "1"}),
    # the io_uring reader with its slots registered (READV_FIXED reads; FASTLOAD_URING_FIXED=1)
    "runai_fastload_uringfixed": ("runai_streamer", {"FASTLOAD_URING_FIXED": "1"}),
    # ipc_cache needs a `vllm-fastload preload` daemon for the same model/TP; started by main() when asked for.
    # ipc_copy releases the daemon's memory, so it must come last.
    "ipc_zero_copy": ("ipc_cache", {}),
    "ipc_copy": ("ipc_cache", {}),
    # peers: vLLM's own load formats of other fast loaders (vLLM 0.26 has both), when their packages are importable
    "instanttensor": ("instanttensor", {}),
    "instanttensor_buffered": ("instanttensor", {"INSTANTTENSOR_BACKEND": "BUFFERED"}),
    "fastsafetensors": ("fastsafetensors", {}),
}
#: Any loader name above with this suffix: the same loader with vLLM's usage statistics off in its engine
#: (VLLM_NO_USAGE_STATS=1). vLLM's GPU worker starts its usage reporter right before load_model, and the reporter
#: runs py-cpuinfo in a child Python process (about a CPU-second) while the weights load.
NOSTATS = "_nostats"


def base_loader(name: str) -> str:
    """``name`` without :data:`NOSTATS`: the key of :data:`LOADERS` it runs."""
    return name[:-len(NOSTATS)] if name.endswith(NOSTATS) else name


#: loader -> the Python package its load format needs (peers run only where it is importable)
NEEDS = {"instanttensor": "instanttensor", "instanttensor_buffered": "instanttensor",
         "fastsafetensors": "fastsafetensors"}
PEERS = "instanttensor,instanttensor_buffered,fastsafetensors"


def available(name: str) -> bool:
    """Whether loader ``name`` can run here (its package importable; ours and vLLM's always)."""
    import importlib.util

    need = NEEDS.get(base_loader(name))
    return need is None or importlib.util.find_spec(need) is not None
#: set by main() when an ipc_cache loader is benchmarked
SOCKET_DIR: list = []

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
t_import = time.perf_counter() - t0
args = json.loads(sys.argv[1])
kw = dict(model=args["model"], load_format=args["load_format"], enforce_eager=True, skip_tokenizer_init=True,
          tensor_parallel_size=args["tp"], max_model_len=args["max_model_len"],
          gpu_memory_utilization=args["gmu"])
if args.get("extra"):
    kw["model_loader_extra_config"] = args["extra"]
if args.get("dtype"):
    kw["dtype"] = args["dtype"]
t1 = time.perf_counter()
llm = LLM(**kw)
t_llm = time.perf_counter() - t1
wall_ready = time.time()
prompt = [{"prompt_token_ids": [1, 450, 783, 310, 344, 338]}]
llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, detokenize=False))
wall_first = time.time()
out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, detokenize=False))
used = None
try:
    import torch
    free, total = torch.cuda.mem_get_info()
    used = total - free  # device-wide: the daemon's memory included
except Exception:
    pass
blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
print("BENCH_RESULT " + json.dumps({"import_s": t_import, "llm_init_s": t_llm, "ids": list(out[0].outputs[0].token_ids),
                                    "wall_ready": wall_ready, "wall_first_token": wall_first,
                                    "gpu_used_bytes": used, "num_gpu_blocks": blocks}), flush=True)
"""

PATTERNS = {
    "model_loading_s": re.compile(r"Model loading took [0-9.]+ GiB (?:memory )?and ([0-9.]+) seconds"),
    "default_weights_s": re.compile(r"Loading weights took ([0-9.]+) seconds"),
    "init_model_s": re.compile(r"Initializing model took ([0-9.]+) seconds"),
    "fastload_weights_s": re.compile(r"fastload: runai_streamer loaded \d+ tensors .*? in ([0-9.]+) s"),
    "fanout": re.compile(r"(fastload: runai_streamer (?:fan-out over|reads the whole checkpoint).*)"),
    "runai_builtin_stream_s": re.compile(r"Overall time to stream .*?: ([0-9.]+)s"),
}


def run_one(name: str, model: str, tp: int, gmu: float, report: Path, extra: dict, dtype: str | None = None,
            max_model_len: int = 1024) -> dict:
    """One loader in a fresh process; returns parsed timings (seconds) and the greedy token ids."""
    label, name = name, base_loader(name)
    fmt, env_over = LOADERS[name]
    env = {**os.environ, **env_over, "PYTHONUNBUFFERED": "1"}
    if label != name:
        env["VLLM_NO_USAGE_STATS"] = "1"
    ex = dict(extra) if name.startswith("runai_fastload") else {}
    if name.startswith("runai_fastload"):
        ex["report_path"] = str(report)
    if name == "runai_fastload_ring":
        ex["pinned_reader"] = False
    if name == "runai_fastload_hashed":
        ex["content_hash"] = True
    if name.startswith("runai_fastload_runai"):
        ex["fs_strategy"] = "sync_buffered"
    if name.startswith("runai_fastload_issue"):
        ex["issue_thread"] = True
    if name.startswith("runai_fastload_prefetch"):
        ex["prefetch"] = True
    if name == "runai_fastload_prefetchc4":
        ex["concurrency"] = 4
    if name.startswith("runai_fastload_uring"):
        ex["fs_strategy"] = "uring_buffered"
        suffix = name[len("runai_fastload_uring"):]
        if suffix.isdigit():  # uring12 / 24 / 48: that many slots, all in flight
            ex["pinned_slots"] = ex["concurrency"] = int(suffix)
        elif suffix == "drv24":
            ex["pinned_slots"], ex["concurrency"] = 24, 16
        elif suffix in ("8m16", "2m32", "1m48"):  # the read request size is the loader's environment
            ex["concurrency"] = int(suffix.split("m")[1])
    slot_mib = {"runai32": 32, "uring16m": 16, "uring32m": 32, "prefetch32m": 32, "prefetch32msw1ms": 32,
                "prefetch64m": 64}
    variant = name[len("runai_fastload_"):] if name.startswith("runai_fastload_") else ""
    if variant in slot_mib:
        ex["pinned_slot_bytes"] = slot_mib[variant] << 20
    if name.startswith("ipc_"):
        ex = {"socket_dir": SOCKET_DIR[-1], "mode": name[4:], "report_path": str(report), "fallback": False}
    timeline = report.with_name(f"{label}.timeline.json")
    timeline.unlink(missing_ok=True)
    if name.endswith("tl"):
        env["FASTLOAD_H2D_TIMELINE"] = str(timeline)
    args = {"model": model, "load_format": fmt, "tp": tp, "gmu": gmu, "extra": ex, "dtype": dtype,
            "max_model_len": max_model_len}
    # the whole log of an engine that fails goes next to its report (the root cause of a failed start is far above
    # the tail the exception shows); one from an earlier run of this loader is not this run's
    failed = report.with_name(f"{label}.failed.log")
    failed.unlink(missing_ok=True)
    t, spawned = time.perf_counter(), time.time()
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True, env=env,
                           timeout=900)
    except subprocess.TimeoutExpired as e:
        out = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        failed.write_text("".join(out))
        raise RuntimeError(f"{label} did not finish within 900 s; what it wrote is in {failed}") from None
    wall = time.perf_counter() - t
    log = p.stdout + p.stderr
    if p.returncode != 0:
        failed.write_text(log)
        raise RuntimeError(f"{label} failed (exit {p.returncode}; whole log in {failed}):\n{log[-4000:]}")
    res = {"loader": label, "process_s": wall}
    for key, rx in PATTERNS.items():
        m = rx.findall(log)
        res[key] = (m[-1] if key == "fanout" else float(m[-1])) if m else None
    res.update(json.loads(log.split("BENCH_RESULT ", 1)[1].splitlines()[0]))
    # restart-to-ready as an autoscaler sees it: process start -> LLM() returned -> first token generated
    res["start_to_ready_s"] = res.pop("wall_ready") - spawned
    res["start_to_first_token_s"] = res.pop("wall_first_token") - spawned
    if report.exists() and name != "auto":
        r = json.loads(report.read_text())
        res["report"] = {k: r.get(k) for k in ("bytes", "wall_s", "read_wait_s", "gb_per_s", "content_digest", "extra")}
        if name.startswith("ipc_"):
            res["ipc_weights_s"] = r["extra"].get("weights_phase_s")
        elif r.get("weights_phase_s") is not None:  # our streamer with prefetch: load_weights' own seconds
            res["fastload_weights_s"] = round(r["weights_phase_s"], 3)
    if timeline.exists():
        res["timeline"] = json.loads(timeline.read_text())["summary"]
    res["log_tail"] = "\n".join(line for line in log.splitlines() if "fastload" in line or "took" in line)[-2000:]
    return res


def h2d_bandwidth() -> dict:
    """Pinned and pageable host-to-device copy bandwidth in GB/s (1 GiB, median of 5), or {} without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    n = 2**30
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for label, host in (("pinned_h2d_gbps", torch.empty(n, dtype=torch.uint8, pin_memory=True)),
                        ("pageable_h2d_gbps", torch.empty(n, dtype=torch.uint8).fill_(1))):
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        out[label] = round(n / statistics.median(times) / 1e9, 2)
    return out


def weights_s(r: dict):
    """The weights phase of one run (seconds): ipc_cache's report, our streamer's line, vLLM's lines."""
    return (r.get("ipc_weights_s") or r.get("fastload_weights_s") or r.get("default_weights_s")
            or r.get("runai_builtin_stream_s"))


def gpu_used() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def page_cache_line(results: dict) -> str:
    """How the page cache was for the runs of ``results``: warm, or cold with what stayed resident and the disk's
    own O_DIRECT speed (``page_cache.disk_limit``)."""
    if not results.get("cold"):
        return "warm"
    resident = sorted({r.get("resident_after_evict") for r in results["loaders"]}, key=str)
    disk = results.get("disk") or {}
    if disk.get("gbps"):
        speed = f"the disk's O_DIRECT reads {disk['gbps']} GB/s (by threads: {disk['by_threads']})"
    else:
        speed = disk.get("error", "the disk's speed not measured")
    return f"cold (dropped before every run; resident after: {resident}), {speed}"


def write_outputs(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    rows = results["loaders"]
    lines = [
        f"Machine: {results['machine']}; date {results['date']}; vLLM {results['vllm']}; torch {results['torch']}; "
        f"model {results['model']} ({results['model_gb']:.2f} GB); TP={results['tp']}; "
        f"H2D pinned {results['h2d'].get('pinned_h2d_gbps', '-')} GB/s, "
        f"pageable {results['h2d'].get('pageable_h2d_gbps', '-')} GB/s; page cache {page_cache_line(results)}",
        "",
        "| loader | weights phase s | weights GB/s | \"Model loading took\" s | LLM() s | start -> ready s "
        "| start -> first token s | GPU used GiB (all processes) | KV blocks | greedy ids equal auto |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    ref = next((r["ids"] for r in rows if r["loader"] == "auto" and "ids" in r), None)
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['loader']} | every run failed: {r['failed'].splitlines()[0][:200]} |" + " |" * 8)
            continue
        w = weights_s(r)
        gbps = results["model_gb"] / w if w else None
        used = r.get("gpu_used_bytes")
        lines.append(
            f"| {r['loader']} | {w if w is not None else '-'} | {f'{gbps:.1f}' if gbps else '-'} | "
            f"{r.get('model_loading_s') or '-'} | {r['llm_init_s']:.2f} | {r['start_to_ready_s']:.2f} | "
            f"{r['start_to_first_token_s']:.2f} | {f'{used / 2**30:.1f}' if used else '-'} | "
            f"{r.get('num_gpu_blocks') or '-'} | {r['ids'] == ref if ref else '-'} |")
    stages = [r for r in rows if r["loader"].startswith("runai_fastload") and r.get("report")]
    if stages:
        keys = ("prepare_s", "first_tensor_s", "last_tensor_s", "read_wait_s", "memcpy_s", "slot_wait_s", "h2d_s",
                "pinned_alloc_s", "pinned_alloc_wait_s",
                "pinned_bytes", "pinned_extra_bytes", "consumer_wait_s", "concurrency", "fs_strategy",
                "uring_iowq_workers", "uring_loader_cpu")
        lines += ["", "Stage timings of our loader (load report; seconds, bytes):", "",
                  "| loader | wall s | " + " | ".join(keys) + " |", "|---" * (len(keys) + 2) + "|"]
        for r in stages:
            rep = r["report"]
            vals = [rep.get(k, rep["extra"].get(k, "-")) for k in keys]
            vals = [round(v, 3) if isinstance(v, float) else v for v in vals]
            lines.append(f"| {r['loader']} | {rep['wall_s']:.3f} | " + " | ".join(str(v) for v in vals) + " |")
        threads = {r["loader"]: r["report"]["extra"].get("other_threads") for r in stages}
        threads = {k: v for k, v in threads.items() if v is not None}  # none after a fallback
        if threads:
            lines += ["", "Other Python threads of the loading process when the stream started (load report): "
                      + "; ".join(f"{k}: {', '.join(v) if v else 'none'}" for k, v in threads.items())]
    timed = [r for r in rows if r.get("timeline")]
    if timed:
        lines += ["", "H2D timelines (streaming/timeline.py; seconds, from the loading thread's first request):", ""]
        for r in timed:
            tl = {k: v for k, v in r["timeline"].items() if k != "largest_gaps"}
            gaps = ", ".join(f"{g['gap_s'] * 1e3:.2f} ms at {g['at_s']:.3f} s (read {g['read_wait_s'] * 1e3:.2f})"
                             for g in r["timeline"].get("largest_gaps", []))
            lines.append(f"- {r['loader']}: `{json.dumps(tl)}`; largest gaps: {gaps or '-'}")
    fan = [r for r in rows if r.get("fanout")]
    if fan:
        lines += ["", "Fan-out (TP > 1; rank 0's line):", ""] + [f"- {r['loader']}: `{r['fanout']}`" for r in fan]
    if results.get("skipped"):
        lines += ["", f"Not importable on this machine, not run: {', '.join(results['skipped'])}"]
    if results.get("daemon"):
        d = results["daemon"]
        lines += ["", f"preload daemon: ready after {d['ready_s']:.1f} s (load + post-process + export); "
                      f"GPU used with only the daemon: {d['gpu_used_bytes'] / 2**30:.1f} GiB"]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = [r["loader"] for r in rows]
        ml = [r.get("model_loading_s") or 0 for r in rows]
        ww = [weights_s(r) or 0 for r in rows]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], ml, 0.4, label='"Model loading took" (s)')
        ax.bar([i + 0.2 for i in x], ww, 0.4, label="weights phase (s)")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("seconds (lower is better)")
        ax.set_title(f"{results['model']} TP={results['tp']}, vLLM {results['vllm']}, {results['date']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "results.png", dpi=120)
    except ImportError:
        pass
    print("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--make", choices=["8b", "1b", "deep", "deep1k", "deep100k", "tiny"],
                    help="create the model directory first (random weights)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=1024,
                    help="each engine's (and the daemon's); deep100k on a 24 GiB CPU host needs 128")
    ap.add_argument("--gmu", type=float, default=0.5)
    ap.add_argument("--loaders", default=f"auto,runai_builtin,runai_fastload,{PEERS}",
                    help="comma-separated; peers whose package is not importable are skipped with a note")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--interleave", action="store_true",
                    help="run the loaders in rounds (one run each per round, --repeats rounds) instead of all runs "
                         "of one loader, then the next; the ipc_cache loaders run after the rounds")
    ap.add_argument("--dtype", default=None,
                    help="the engines' and the daemon's --dtype (default: the model config's); on CPU say float32")
    ap.add_argument("--extra", default="{}", help="extra-config JSON for runai_fastload")
    ap.add_argument("--daemon-extra", default=None,
                    help="extra-config JSON of the preload daemon (its runai_streamer load), "
                         "e.g. '{\"content_hash\": true}'")
    ap.add_argument("--cold", action="store_true",
                    help="a cold page cache: the shards' pages dropped before every run (page_cache.evict) instead "
                         "of warmed once, and the disk's own O_DIRECT read speed measured first (the limit)")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)  # a failed engine's log goes there before any result
    if a.make:
        sys.path.insert(0, str(HERE))
        from make_model import make

        make(a.model, a.make)
    import torch
    import vllm

    files = sorted(a.model.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    shards = [str(f) for f in files]
    disk = None
    if a.cold:
        sys.path.insert(0, str(HERE))
        from page_cache import disk_limit

        disk = disk_limit(shards)
        print(f"[bench] cold page cache; the disk's O_DIRECT reads: {disk}", flush=True)
    else:
        for f in files:  # warm the page cache
            with open(f, "rb") as fh:
                while fh.read(64 * 2**20):
                    pass
    h2d = h2d_bandwidth()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    results = {"machine": f"{gpu} x{max(torch.cuda.device_count(), 1)}, {os.cpu_count()} CPUs ({host_cpu()})",
               "date": time.strftime("%Y-%m-%d"),
               "vllm": vllm.__version__, "torch": torch.__version__, "model": a.model.name, "model_gb": size / 1e9,
               "tp": a.tp, "h2d": h2d, "command": " ".join(sys.argv), "loaders": [], "cold": a.cold, "disk": disk,
               "boot_id": boot_id()}
    names = [n for n in a.loaders.split(",") if available(n)]
    results["skipped"] = [n for n in a.loaders.split(",") if not available(n)]
    if results["skipped"]:
        print(f"[bench] not importable here, skipped: {', '.join(results['skipped'])}", flush=True)
    daemon = None
    runs: dict[str, list] = {}
    try:
        if a.interleave:
            # rounds of one run per loader (A B C A B C ...): a drift of the machine during the call (another
            # tenant, the page cache, clocks) falls on every loader alike instead of on whichever ran last. The
            # ipc_cache loaders are not in the rounds: their daemon would sit beside the disk loaders' later rounds,
            # and a copy-mode engine empties it for the next round's engines; they run after, one after another
            rounds = [n for n in names if not n.startswith("ipc_")]
            runs = {name: [] for name in rounds}
            for _ in range(a.repeats):
                for name in rounds:
                    runs[name].append(one_run(name, a, shards))
            for name in rounds:
                keep_median(name, runs[name], results)
        for name in [n for n in names if n not in runs]:  # all of them without --interleave
            if name.startswith("ipc_") and daemon is None:
                daemon = start_daemon(a, results)  # only now, so it does not compete with the disk loaders
            if name != "ipc_copy":
                run_loader(name, a, results, shards)
                continue
            copies = []
            for k in range(a.repeats):
                if k:  # the copy-mode engine before emptied the daemon: each run gets a fresh one
                    daemon.stop()
                    daemon = start_daemon(a, results)
                copies.append(one_run(name, a, shards))
            keep_median(name, copies, results)
    finally:
        if daemon is not None:
            daemon.stop()
    write_outputs(results, a.out)
    failed = [r["loader"] for r in results["loaders"] if r.get("failed")]
    if failed:
        print(f"[bench] every run of {', '.join(failed)} failed (results.json has why)", flush=True)
    return 1 if failed else 0


def boot_id() -> str | None:
    """This boot of the host (Linux's ``/proc/sys/kernel/random/boot_id``, a UUID drawn at each boot), or None
    where it cannot be read: results files with the same one come from one machine start, which a target judged
    over several calls on one host (``tp1_target.py``) asks for."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def host_cpu() -> str:
    """The CPU model and its last-level cache, as Linux reports them (``/proc/cpuinfo``'s first "model name", the
    size of cpu0's highest cache index under ``/sys/devices/system/cpu``): hosts of one device kind differ there,
    and the TP=1 load times with them (docs/benchmarks.md, TP=1); "unknown" for what cannot be read."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"), key=lambda d: int(d.name[5:]))
    try:
        last = caches[-1]
        return f"{model}, L{(last / 'level').read_text().strip()} {(last / 'size').read_text().strip()}"
    except (IndexError, OSError):
        return f"{model}, last-level cache unknown"


def start_daemon(a: argparse.Namespace, results: dict):
    """Start `vllm-fastload preload` for the model (same TP) and wait until it serves; records its start time and
    the GPU memory it holds."""
    import tempfile

    sys.path.insert(0, str(HERE.parent / "src"))
    from vllm_fastload.servers import PreloadDaemon

    sock = Path(tempfile.mkdtemp(prefix="fastload-bench-sock-"))
    SOCKET_DIR.append(str(sock))
    a.out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    args = ["--tensor-parallel-size", str(a.tp), "--max-model-len", str(a.max_model_len)]
    args += ["--dtype", a.dtype] if a.dtype else []
    if a.daemon_extra:
        args += ["--model-loader-extra-config", a.daemon_extra]
    daemon = PreloadDaemon(str(a.model), sock, args, log_path=a.out / "preload.log").ready_or_raise()
    results["daemon"] = {"ready_s": time.perf_counter() - t, "gpu_used_bytes": gpu_used(), "extra": a.daemon_extra}
    return daemon


def run_loader(name: str, a: argparse.Namespace, results: dict, shards: list[str]) -> None:
    """Run one loader ``--repeats`` times, keep the median run in ``results``."""
    keep_median(name, [one_run(name, a, shards) for _ in range(a.repeats)], results)


def one_run(name: str, a: argparse.Namespace, shards: list[str]) -> dict:
    """One run of loader ``name`` (:func:`run_one`); with ``--cold`` the pages of ``shards`` (the model's files)
    are dropped first and what stayed resident is recorded."""
    resident = None
    if a.cold:  # the engine starts with none of the shards' pages in memory
        from page_cache import evict

        resident = evict(shards)
        resident = None if resident is None else round(resident, 3)
    try:
        run = run_one(name, str(a.model), a.tp, a.gmu, a.out / f"{name}.report.json", json.loads(a.extra), a.dtype,
                      a.max_model_len)
    except RuntimeError as e:  # one engine that failed must not take the other loaders' results with it
        print(f"[bench] {name}: this run failed: {str(e).splitlines()[0]}", flush=True)
        run = {"loader": name, "failed": str(e)[:4000]}
    run["resident_after_evict"] = resident
    # each run as soon as it ends, one JSON line: a call cut by its time limit (the GPU machine's budget) keeps the
    # runs it finished, which results.json (written once at the end) would lose
    with open(a.out / "runs.jsonl", "a") as fh:
        fh.write(json.dumps({k: v for k, v in run.items() if k != "log_tail"}, default=str) + "\n")
    if not run.get("failed"):
        print(f"[bench] run of {name}: weights phase {weights_s(run)} s, \"Model loading took\" "
              f"{run.get('model_loading_s')} s", flush=True)
    return run


def keep_median(name: str, runs: list[dict], results: dict) -> None:
    """Append the median of ``runs`` (by "Model loading took", else ``LLM()``) to ``results``, with every run's
    weights phase in ``weights_s_runs`` and the number of failed runs in ``failed_runs`` (failed runs are left out;
    when every run failed, the first one's failure is appended)."""
    failed = len([r for r in runs if r.get("failed")])
    runs = [r for r in runs if not r.get("failed")] or runs[:1]
    if runs[0].get("failed"):
        results["loaders"].append({**runs[0], "failed_runs": failed})
        return
    key = "model_loading_s" if runs[0].get("model_loading_s") is not None else "llm_init_s"
    runs.sort(key=lambda r: r[key] or 0)
    best = runs[len(runs) // 2]
    weights = [weights_s(r) for r in runs]
    best["weights_s_runs"] = weights  # every run's weights phase, in the order of their "Model loading took"
    best["failed_runs"] = failed
    results["loaders"].append(best)
    print(f"[bench] {name}: {best.get('model_loading_s')} s model loading; weights phase of each run {weights}; "
          f"{best['log_tail'][-400:]}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
