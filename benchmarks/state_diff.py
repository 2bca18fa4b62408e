"""Whether load formats leave a vLLM engine's model in the same state, tensor by tensor, and give the same logprobs.

Greedy ids of a random-weight model agree as long as no step's two best logits are nearly tied; a tensor that is
slightly off (a norm weight of the wrong layer, a cache in another precision) can pass them for many tokens. This
compares what a greedy-id test cannot: every tensor the model reaches (``benchmarks/model_state.py``: each module's
parameters, buffers and tensor attributes, under every module path; not the attention layers' ``kv_cache``) by
dtype, shape, stride, a SHA-256 of its bytes, its class (vLLM's parameter classes) and its device type, and the
chosen tokens' logprobs, of each loader against the first (``auto``).

Each loader runs in a fresh process (``vllm.LLM(..., enforce_eager=True)``, the model reached through
``LLM.collective_rpc``, which pickles the function: benchmark-only, ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
``ipc_*`` loaders get a ``vllm-fastload preload`` daemon started for the model first. Usage::

    python3 benchmarks/state_diff.py --model DIR [--loaders auto,ipc_zero_copy,ipc_copy,runai_streamer]
        [--dtype float32] [--out DIR]

Prints and writes ``DIR/state-diff.json``: per loader, tensors only it has or only the first has, tensors whose
dtype/shape/stride, bytes, class or device differ (names), greedy ids equal, max abs logprob difference. Exit 1
when any loader differs from the first in any of these.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams
a = json.loads(sys.argv[1])
kw = dict(model=a["model"], load_format=a["fmt"], enforce_eager=True, skip_tokenizer_init=True, max_model_len=512,
          gpu_memory_utilization=a["gmu"], model_loader_extra_config=a["extra"])
if a.get("dtype"):
    kw["dtype"] = a["dtype"]
llm = LLM(**kw)

exec(a["state_src"])  # defines state(worker): benchmarks/model_state.py
st = llm.collective_rpc(state)[0]
prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 31], [7, 7, 7, 1000], [42])]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, detokenize=False, logprobs=0))
ids = [list(o.outputs[0].token_ids) for o in outs]
lps = [[step[tok].logprob for step, tok in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
print("STATE " + json.dumps({"state": st, "ids": ids, "logprobs": lps}), flush=True)
"""

#: loader name -> (load format, extra-config without the socket dir)
LOADERS = {
    "auto": ("auto", {}),
    "runai_streamer": ("runai_streamer", {}),
    "ipc_zero_copy": ("ipc_cache", {"mode": "zero_copy", "fallback": False}),
    "ipc_copy": ("ipc_cache", {"mode": "copy", "fallback": False}),
}


def run(model: Path, name: str, socket_dir: str | None, gmu: float, dtype: str | None, log: Path) -> dict:
    """One loader in a fresh process: ``{"state": name -> [kind, dtype, shape, stride, sha256, class, device type],
    "ids", "logprobs"}``.
    Raises ``RuntimeError`` with the log's tail when the engine fails."""
    fmt, extra = LOADERS[name]
    if fmt == "ipc_cache":
        extra = dict(extra, socket_dir=socket_dir)
    from model_state import STATE_SRC

    arg = json.dumps({"model": str(model), "fmt": fmt, "extra": extra, "gmu": gmu, "dtype": dtype,
                      "state_src": STATE_SRC})
    p = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    text = p.stdout + p.stderr
    log.write_text(text)
    if p.returncode != 0 or "STATE " not in text:
        raise RuntimeError(f"{name} failed (exit {p.returncode}; log {log}):\n{text[-3000:]}")
    return json.loads(text.split("STATE ", 1)[1].splitlines()[0])


def compare(ref: dict, got: dict) -> dict:
    """What differs between two :func:`run` results: names only in one, names whose layout (kind, dtype, shape,
    stride), bytes, or tensor class or device type differ (``class_differs``), whether the greedy ids are equal, the
    largest logprob difference of the steps both chose the same token in."""
    a, b = ref["state"], got["state"]
    layout = sorted(n for n in a.keys() & b.keys() if a[n][:4] != b[n][:4])
    content = sorted(n for n in a.keys() & b.keys() if a[n][:4] == b[n][:4] and a[n][4] != b[n][4])
    classes = sorted(n for n in a.keys() & b.keys() if a[n][5:] != b[n][5:])  # class or device type
    diffs = [abs(x - y) for ra, rb, ia, ib in zip(ref["logprobs"], got["logprobs"], ref["ids"], got["ids"])
             for x, y, ta, tb in zip(ra, rb, ia, ib) if ta == tb]
    return {"only_reference": sorted(a.keys() - b.keys()), "only_this": sorted(b.keys() - a.keys()),
            "layout_differs": layout, "bytes_differ": content, "class_differs": classes, "tensors": len(b),
            "ids_equal": ref["ids"] == got["ids"],
            "max_abs_logprob_diff": max(diffs) if diffs else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--loaders", default="auto,ipc_zero_copy,ipc_copy")
    ap.add_argument("--gmu", type=float, default=0.3)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", type=Path, default=Path("state-diff-out"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    names = a.loaders.split(",")
    unknown = [n for n in names if n not in LOADERS]
    if unknown:
        ap.error(f"unknown loader(s) {unknown}; choose from {sorted(LOADERS)}")
    sys.path.insert(0, str(HERE.parent / "src"))
    from vllm_fastload.servers import PreloadDaemon

    daemon, sock, results = None, None, {}
    try:
        for name in names:
            if LOADERS[name][0] == "ipc_cache" and daemon is None:
                sock = tempfile.mkdtemp(prefix="fastload-state-sock-")
                args = ["--max-model-len", "512"] + (["--dtype", a.dtype] if a.dtype else [])
                daemon = PreloadDaemon(str(a.model), Path(sock), args, log_path=a.out / "preload.log").ready_or_raise()
            results[name] = run(a.model, name, sock, a.gmu, a.dtype, a.out / f"{name}.log")
    finally:
        if daemon is not None:
            daemon.stop()
    ref = names[0]
    report = {n: compare(results[ref], results[n]) for n in names[1:]}
    report["_reference"] = {"loader": ref, "tensors": len(results[ref]["state"]), "ids": results[ref]["ids"]}
    (a.out / "state-diff.json").write_text(json.dumps(report, indent=1))
    bad = False
    for n in names[1:]:
        r = report[n]
        differs = (r["only_reference"] or r["only_this"] or r["layout_differs"] or r["bytes_differ"]
                   or r["class_differs"])
        bad |= bool(differs) or not r["ids_equal"]
        print(f"{n} against {ref}: {r['tensors']} tensors; only {ref}: {r['only_reference'][:8]}; only {n}: "
              f"{r['only_this'][:8]}; layout differs: {r['layout_differs'][:8]}; bytes differ: "
              f"{r['bytes_differ'][:8]} ({len(r['bytes_differ'])}); class or device differs: {r['class_differs'][:8]} "
              f"({len(r['class_differs'])}); greedy ids equal: {r['ids_equal']}; "
              f"max abs logprob diff: {r['max_abs_logprob_diff']}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
