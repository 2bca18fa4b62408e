"""README.md's `ipc_cache` block ("Paste this into a shell") runs as pasted: a preload daemon, an engine mapping
its weights, the demo's question answered "Paris", `status`, both stopped. Only its two ports are swapped for free
ones (so a busy 8000 does not fail the test), and a trap stops both servers by PID if the block fails midway."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.e2e

from vllm_fastload.servers import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def readme_ipc_block() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("```bash\n", text.index("Paste this into a shell")) + len("```bash\n")
    return text[start:text.index("```", start)]


def test_readme_ipc_cache_block_runs_as_pasted(demo_model, tmp_path):
    block = readme_ipc_block()
    assert "8099" in block and "8000" in block
    block = block.replace("8099", str(free_port())).replace("8000", str(free_port()))
    script = tmp_path / "readme.sh"
    script.write_text("set -eo pipefail\ntrap 'kill ${ENGINE:-} ${DAEMON:-} 2>/dev/null || true' EXIT\n" + block)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")}
    env["TMPDIR"] = str(tmp_path)  # mktemp -d: the block's socket and log directories land here
    p = subprocess.run(["bash", str(script)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200,
                       start_new_session=True)
    logs = [d for d in tmp_path.glob("tmp.*") if (d / "engine.log").exists()]
    tail = "".join(f"\n--- {f}:\n{f.read_text()[-3000:]}" for d in logs for f in d.iterdir())
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}{tail}"
    answer = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("{")))
    assert "Paris" in answer["choices"][0]["message"]["content"], answer
    assert re.search(r"fastload: ipc_cache mapped \d+ tensors .* no disk read", p.stdout), p.stdout
    assert "ready" in p.stdout  # vllm-fastload status
