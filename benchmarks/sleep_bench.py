"""vLLM's sleep mode with our loaders: seconds to sleep, wake and reload, and greedy ids after each wake (issue 16).

    python benchmarks/sleep_bench.py --model DIR [--make 8b|tiny] [--cases runai_streamer,zero_copy,copy]
           [--out DIR]

One engine per case, each in a fresh process, ``LLM(..., enable_sleep_mode=True)`` (vLLM's sleep mode runs on
CUDA only): greedy ids, then ``sleep(level=1)`` / ``wake_up()`` and ``sleep(level=2)`` / ``wake_up()``, greedy ids
after each wake. Level 2 discards what vLLM allocated, so the engine reloads its weights
(``collective_rpc("reload_weights")``, the RL loops' flow) except ``ipc_cache`` zero_copy, whose weights are the
daemon's memory (outside vLLM's sleep allocator, they stay mapped). The ``ipc_cache`` cases map from a
``vllm-fastload preload`` daemon this script starts (copy mode runs last: it lets the daemon free its memory).
After ``LLM()`` the child also asks the engine (``collective_rpc``) what it holds: KV cache blocks, vLLM's weights
memory, PyTorch's allocated and reserved bytes and vLLM's sleep allocator per tag (a KV cache larger than
``auto``'s means memory was counted wrong). Writes ``sleep.json`` and ``sleep.md`` under ``--out``.
``tests/gpu/test_sleep_gpu.py`` runs the same child (:func:`run_case`) on small models: greedy ids, KV blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time, torch
from vllm import LLM, SamplingParams
a = json.loads(sys.argv[1])
t = time.perf_counter()
llm = LLM(model=a["model"], load_format=a["fmt"], enforce_eager=True, skip_tokenizer_init=True, max_model_len=512,
          gpu_memory_utilization=a["gmu"], model_loader_extra_config=a["extra"], enable_sleep_mode=True)
out = {"llm_s": time.perf_counter() - t}
def engine_memory(worker):
    # what the engine holds once loaded: torch's counters, vLLM's sleep allocator per tag, the KV cache's blocks
    import collections, torch
    from vllm.device_allocator.cumem import CuMemAllocator
    tags = collections.Counter()
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        tags[data.tag] += data.handle[1]
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "sleep_pool_by_tag": dict(tags), "weights_memory": int(worker.model_runner.model_memory_usage),
            "kv_blocks": worker.cache_config.num_gpu_blocks}
out["memory"] = llm.collective_rpc(engine_memory)[0]
prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 31], [7, 7, 7, 1000], [42])]
def ids():
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, detokenize=False), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]
out["before"] = ids()
for level in (1, 2):
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    t = time.perf_counter(); llm.sleep(level=level); out[f"sleep{level}_s"] = time.perf_counter() - t
    out[f"freed{level}_bytes"] = torch.cuda.mem_get_info()[0] - free0
    t = time.perf_counter(); llm.wake_up(); torch.cuda.synchronize(); out[f"wake{level}_s"] = time.perf_counter() - t
    if level == 2 and a["reload_after_level2"]:
        t = time.perf_counter(); llm.collective_rpc("reload_weights"); torch.cuda.synchronize()
        out["reload_s"] = time.perf_counter() - t
    t = time.perf_counter(); out[f"after{level}"] = ids(); out[f"generate_after{level}_s"] = time.perf_counter() - t
print("SLEEP " + json.dumps(out), flush=True)
"""

#: case -> (load format, extra config without the socket dir, reload after level 2)
CASES = {
    "auto": ("auto", {}, True),  # vLLM's default loader: the peer of the reload
    "runai_streamer": ("runai_streamer", {}, True),
    "zero_copy": ("ipc_cache", {"mode": "zero_copy", "fallback": False}, False),
    "copy": ("ipc_cache", {"mode": "copy", "fallback": False}, True),
}


def run_case(model: Path, case: str, socket_dir: str | None, log: Path, gmu: float = 0.3) -> tuple[dict, str]:
    """Run ``case`` (a key of :data:`CASES`) in a fresh process on ``model``; ``socket_dir``: the preload daemon's
    (``ipc_cache`` cases). Returns the child's numbers (seconds, bytes freed by each sleep, greedy ids ``before``,
    ``after1``, ``after2``) and its log, which is also written to ``log``. Raises ``RuntimeError`` with the log's
    tail when the child fails."""
    fmt, extra, reload_after = CASES[case]
    extra = dict(extra, **({"socket_dir": socket_dir} if fmt == "ipc_cache" else {}))
    arg = json.dumps({"model": str(model), "fmt": fmt, "extra": extra, "reload_after_level2": reload_after,
                      "gmu": gmu})
    p = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1",
                            # the child's memory report is a function sent to the engine (collective_rpc): vLLM
                            # pickles it only when this is set; benchmark-only, nothing of ours crosses a socket
                            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    text = p.stdout + p.stderr
    Path(log).write_text(text)
    if p.returncode != 0 or "SLEEP " not in text:
        raise RuntimeError(f"{case} failed (exit {p.returncode}):\n{text[-4000:]}")
    return json.loads(text.split("SLEEP ", 1)[1].splitlines()[0]), text


def table(results: dict) -> str:
    rows = ["| case | `LLM()` s | sleep(1) s | wake_up() s | sleep(2) s | wake_up() s | reload_weights s | "
            "freed by sleep(1) GB | freed by sleep(2) GB | greedy ids after each wake equal before |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for case, r in results["cases"].items():
        same = r["after1"] == r["before"] and r["after2"] == r["before"]
        reload = f"{r['reload_s']:.3f}" if "reload_s" in r else "none needed"
        rows.append(f"| {case} | {r['llm_s']:.2f} | {r['sleep1_s']:.3f} | {r['wake1_s']:.3f} | {r['sleep2_s']:.3f} | "
                    f"{r['wake2_s']:.3f} | {reload} | {r['freed1_bytes'] / 1e9:.1f} | {r['freed2_bytes'] / 1e9:.1f} | "
                    f"{'yes' if same else 'NO'} |")
    rows += ["", "| case | KV blocks | vLLM's weights memory GB | torch allocated GB | torch reserved GB | "
             "sleep allocator by tag GB |", "|---|---|---|---|---|---|"]
    for case, r in results["cases"].items():
        m = r.get("memory")
        if m:
            tags = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in sorted(m["sleep_pool_by_tag"].items()))
            rows.append(f"| {case} | {m['kv_blocks']} | {m['weights_memory'] / 1e9:.1f} | {m['allocated'] / 1e9:.1f} | "
                        f"{m['reserved'] / 1e9:.1f} | {tags} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--make", choices=["8b", "tiny"], help="write the synthetic model first (make_model.py)")
    ap.add_argument("--cases", default="runai_streamer,zero_copy,copy")
    ap.add_argument("--gmu", type=float, default=0.3, help="gpu_memory_utilization of each engine")
    ap.add_argument("--out", type=Path, default=Path("sleep-out"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.make:
        subprocess.run([sys.executable, str(HERE / "make_model.py"), str(a.model), "--shape", a.make], check=True,
                       stdout=subprocess.DEVNULL)
    unknown = sorted(set(a.cases.split(",")) - set(CASES))
    if unknown:
        ap.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(CASES)})")
    cases = [c for c in CASES if c in a.cases.split(",")]  # copy after zero_copy: it frees the daemon's memory
    results: dict = {"model": str(a.model), "date": time.strftime("%Y-%m-%d"), "cases": {}}
    daemon = None
    sock = None
    try:
        for case in cases:
            if CASES[case][0] == "ipc_cache" and daemon is None:
                sys.path.insert(0, str(HERE.parent / "src"))
                from vllm_fastload.servers import PreloadDaemon

                sock = tempfile.mkdtemp(prefix="fastload-sleep-sock-")
                t = time.perf_counter()
                daemon = PreloadDaemon(str(a.model), Path(sock), ["--max-model-len", "512"],
                                       log_path=a.out / "preload.log").ready_or_raise(900)
                results["daemon_ready_s"] = time.perf_counter() - t
            r, _ = run_case(a.model, case, sock, a.out / f"{case}.log", a.gmu)
            results["cases"][case] = r
            shown = {k: v for k, v in r.items() if not k.startswith(("before", "after"))}
            print(f"[sleep] {case}: " + json.dumps(shown),
                  flush=True)
    finally:
        if daemon is not None:
            daemon.stop()
        # also when a case failed: the finished cases' numbers are kept
        (a.out / "sleep.json").write_text(json.dumps(results, indent=1))
        (a.out / "sleep.md").write_text(table(results))
        print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
