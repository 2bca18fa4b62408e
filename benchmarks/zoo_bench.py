"""Parity over the model zoo (benchmarks/model_zoo.py) on a GPU: for each checkpoint, vLLM's default loader (`auto`),
our `runai_streamer` and `ipc_cache` (zero_copy, copy) against a preload daemon: greedy ids, their logprobs, the
weights phase and vLLM's "Model loading took". Each engine runs in its own process (`vllm.LLM`, eager, TP=1).

    python benchmarks/zoo_bench.py --models mixtral-small,deepseek-v3-small --out OUT [--loaders auto,ipc_zero_copy]
        [--lanes 2] [--models-dir /root/models]

``--lanes N`` runs N models at a time (each lane one model after another; every engine takes --gmu of the GPU);
with ``--kv-bytes`` each engine's KV cache has that fixed size, so vLLM skips the memory profile that engines
starting beside each other upset ("No available memory for the cache blocks").
Writes OUT/zoo.json and OUT/zoo.md (one row per model and loader) and every engine's and daemon's log. Exit code 1
when a loader's ids differ from `auto`'s, an ipc_cache engine fell back or read the disk, or an engine failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

#: the engine: greedy ids and the logprob of each chosen token for three token prompts, as one RESULT line
CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams
a = json.loads(sys.argv[1])
kw = dict(model=a["model"], load_format=a["fmt"], enforce_eager=True, skip_tokenizer_init=True, max_model_len=512,
          gpu_memory_utilization=a["gmu"], model_loader_extra_config=a["extra"], **a["engine"])
if a["kv_bytes"]:  # a fixed KV cache: vLLM skips its memory profile, which engines beside each other upset
    kw["kv_cache_memory_bytes"] = a["kv_bytes"]
llm = LLM(**kw)
prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 31], [7, 7, 7, 1000], [42, 3, 17, 256, 9, 11])]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, detokenize=False, logprobs=0))
res = []
for o in outs:
    c = o.outputs[0]
    res.append({"ids": list(c.token_ids), "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]})
print("RESULT " + json.dumps(res), flush=True)
"""
#: our loaders' extra-config per loader name
LOADERS = {"auto": ("auto", {}), "runai_streamer": ("runai_streamer", {}),
           "ipc_zero_copy": ("ipc_cache", {"mode": "zero_copy", "fallback": False}),
           "ipc_copy": ("ipc_cache", {"mode": "copy", "fallback": False})}
MODEL_LOADING = re.compile(r"Model loading took .*? and ([0-9.]+) seconds")


def engine_args(name: str) -> dict:
    """Engine args of a zoo entry beyond its config: its dtype, given explicitly (vLLM's CPU backend would pick
    bfloat16 for a float32 config; daemon and engine must agree: the fingerprint), and what vLLM quantizes itself
    (model_zoo.ENGINE_ARGS: online FP8, FP8 KV cache). A checkpoint's own quantization comes from its config."""
    from model_zoo import ENGINE_ARGS, ZOO

    return {"dtype": ZOO[name][2], **ENGINE_ARGS.get(name, {})}


def cli_args(engine: dict) -> list[str]:
    """``engine`` (LLM keyword arguments) as the daemon's command-line flags: ``kv_cache_dtype`` ->
    ``--kv-cache-dtype``."""
    return [x for k, v in engine.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def run_engine(model: Path, loader: str, out: Path, gmu: float, sock: Path | None, engine: dict,
               kv_bytes: int = 0) -> dict:
    """One engine: its RESULT, "Model loading took", our load report's weights phase and what it fell back to."""
    fmt, extra = LOADERS[loader]
    extra = dict(extra)
    report = out / f"{loader}.report.json"
    if fmt != "auto":
        extra["report_path"] = str(report)
    if sock is not None and fmt == "ipc_cache":
        extra["socket_dir"] = str(sock)
    arg = json.dumps({"model": str(model), "fmt": fmt, "extra": extra, "gmu": gmu, "engine": engine,
                      "kv_bytes": kv_bytes})
    log = out / f"{loader}.log"
    t = time.perf_counter()
    import shutil

    tmp = tempfile.mkdtemp(prefix="fastload-zoo-engine-")  # vLLM's ZMQ sockets and rendezvous files, removed below
    try:
        with open(log, "w") as fh:
            p = subprocess.run([sys.executable, "-c", CHILD, arg], stdout=fh, stderr=subprocess.STDOUT, timeout=900,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": tmp})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = log.read_text(errors="replace")
    row = {"loader": loader, "exit": p.returncode, "start_to_result_s": round(time.perf_counter() - t, 1)}
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    row["result"] = json.loads(lines[-1][7:]) if lines else None
    m = MODEL_LOADING.findall(text)
    row["model_loading_s"] = float(m[-1]) if m else None
    if report.exists():
        r = json.loads(report.read_text())
        row.update(format_used=r["format_used"], fallback_reason=r["fallback_reason"],
                   weights_phase_s=r.get("extra", {}).get("weights_phase_s", r.get("wall_s")), note=r.get("note"))
    if row["result"] is None:
        from vllm_fastload.servers import error_line

        row["error"] = (error_line(text) or text[-400:])[:400]
    return row


def run_model(name: str, loaders: list[str], root: Path, out: Path, gmu: float, kv_bytes: int = 0) -> dict:
    """Every loader on zoo entry ``name`` (made under ``root`` first); the daemon only for ipc_cache loaders."""
    from model_zoo import make

    from vllm_fastload.servers import PreloadDaemon

    model = make(root / name, name)
    for f in model.glob("*.safetensors"):  # warm page cache: every loader reads from memory
        f.read_bytes()
    mout = out / name
    mout.mkdir(parents=True, exist_ok=True)
    eng = engine_args(name)
    rows, daemon, sock = [], None, None
    try:
        for loader in loaders:
            if loader.startswith("ipc_") and daemon is None:
                sock = Path(tempfile.mkdtemp(prefix="fastload-zoo-sock-"))
                args = ["--max-model-len", "512", "--gpu-memory-utilization", str(gmu), *cli_args(eng)]
                t = time.perf_counter()
                daemon = PreloadDaemon(str(model), sock, args, log_path=mout / "preload.log")
                if not daemon.wait_ready(900):
                    rows.append({"loader": "daemon", "exit": daemon.proc.poll(), "error": daemon.reason()})
                    break
                rows.append({"loader": "daemon", "ready_s": round(time.perf_counter() - t, 1),
                             "exported": next((ln.split("fastload: ")[-1] for ln in daemon.log().splitlines()
                                               if "exported as is" in ln), None)})
            rows.append(run_engine(model, loader, mout, gmu, sock, eng, kv_bytes))
            print(f"[zoo] {name} {loader}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'result'})}",
                  flush=True)
    finally:
        if daemon is not None:
            daemon.stop()
        if sock is not None:
            import shutil

            shutil.rmtree(sock, ignore_errors=True)
    res = {"model": name, "rows": rows, "verdict": verdict(rows)}
    print(f"[zoo] {name} verdict: {res['verdict'] or 'ok'}\n" + table([res]), flush=True)
    return res


def verdict(rows: list[dict]) -> list[str]:
    """What is wrong with a model's rows (empty: every loader gave `auto`'s ids, ipc_cache mapped)."""
    ref = next((r["result"] for r in rows if r["loader"] == "auto"), None)
    bad = []
    for r in rows:
        if r["loader"] == "daemon":
            if "error" in r:
                bad.append(f"daemon: {r['error']}")
            continue
        if r.get("result") is None:
            bad.append(f"{r['loader']}: no result ({r.get('error')})")
        elif ref is not None and [x["ids"] for x in r["result"]] != [x["ids"] for x in ref]:
            bad.append(f"{r['loader']}: ids differ from auto")
        if r["loader"].startswith("ipc_") and (r.get("format_used") != "ipc_cache"
                                               or "no disk read" not in (r.get("note") or "")):
            bad.append(f"{r['loader']}: did not map ({r.get('fallback_reason')})")
    return bad


def max_logprob_diff(rows: list[dict], loader: str) -> float | None:
    ref = next((r["result"] for r in rows if r["loader"] == "auto"), None)
    got = next((r.get("result") for r in rows if r["loader"] == loader), None)
    if not ref or not got:
        return None
    return max(abs(a - b) for x, y in zip(ref, got) for a, b in zip(x["logprobs"], y["logprobs"]))


def table(results: list[dict]) -> str:
    out = ["| checkpoint | loader | greedy ids = auto | max abs logprob diff | weights phase s | Model loading took s |"
           " verdict |", "|---|---|---|---|---|---|---|"]
    for res in results:
        ref = next((r["result"] for r in res["rows"] if r["loader"] == "auto"), None)
        for r in res["rows"]:
            if r["loader"] == "daemon":
                continue
            same = (r.get("result") is not None and ref is not None
                    and [x["ids"] for x in r["result"]] == [x["ids"] for x in ref])
            d = max_logprob_diff(res["rows"], r["loader"])
            wp = r.get("weights_phase_s")
            why = r.get("error") or r.get("fallback_reason") or ""
            ids = "no auto row" if ref is None else "yes" if same else "NO"
            out.append(f"| {res['model']} | {r['loader']} | {ids} | "
                       f"{'' if d is None else f'{d:.2e}'} | {'' if wp is None else f'{wp:.3f}'} | "
                       f"{r.get('model_loading_s') or ''} | {why[:160]} |")
    return "\n".join(out) + "\n"


def write(out: Path, ordered: list[dict], meta: dict) -> str:
    """Write ``zoo.json`` and ``zoo.md`` for the models in ``ordered`` (``run_model``'s results) under ``out``;
    returns the Markdown."""
    (out / "zoo.json").write_text(json.dumps({**meta, "results": ordered}, indent=1))
    md = (f"Machine: {meta['machine']}; vLLM {meta['vllm']}, torch {meta['torch']}; {meta['date']}; "
          f"`{meta['command']}`\n\n" + table(ordered))
    for res in ordered:
        for b in res["verdict"]:
            md += f"\n- {res['model']}: {b}"
    (out / "zoo.md").write_text(md + "\n")
    return md


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", required=True, help="comma-separated zoo names (benchmarks/model_zoo.py --list)")
    ap.add_argument("--loaders", default="auto,runai_streamer,ipc_zero_copy,ipc_copy")
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--gmu", type=float, default=0.2)
    ap.add_argument("--kv-bytes", type=int, default=0,
                    help="KV cache bytes per engine (vLLM's kv_cache_memory_bytes; 0: profile). "
                         "Set it with --lanes > 1")
    ap.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "fastload-zoo")
    ap.add_argument("--out", type=Path, default=Path("zoo-out"))
    a = ap.parse_args()
    import torch
    import vllm

    names = a.models.split(",")
    loaders = a.loaders.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    queue = list(names)
    meta = {"machine": f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, {os.cpu_count()} CPUs",
            "date": time.strftime("%Y-%m-%d"), "vllm": vllm.__version__, "torch": torch.__version__,
            "command": " ".join(sys.argv)}
    lock = threading.Lock()

    def lane() -> None:
        while True:
            with lock:
                if not queue:
                    return
                name = queue.pop(0)
            try:
                res = run_model(name, loaders, a.models_dir, a.out, a.gmu, a.kv_bytes)
            except Exception as e:  # a model that cannot even be written or started: a row saying why
                res = {"model": name, "rows": [], "verdict": [f"{type(e).__name__}: {e}"]}
            with lock:
                results[name] = res
                # the tables so far, after every model: a call cut short by its time limit keeps what finished
                write(a.out, [results[n] for n in names if n in results], meta)

    threads = [threading.Thread(target=lane) for _ in range(max(1, a.lanes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ordered = [results[n] for n in names if n in results]
    print(write(a.out, ordered, meta), flush=True)
    return 1 if any(r["verdict"] for r in ordered) else 0


if __name__ == "__main__":
    raise SystemExit(main())
