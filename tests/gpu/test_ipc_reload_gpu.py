"""vLLM's ``reload_weights`` on ``ipc_cache`` engines on CUDA (issue 16; run on the device: ``bash benchmarks/device.sh
ipctests``).

The CUDA VMM transport maps the daemon's memory read-write and shared, so a zero_copy engine refuses the reload
(``ReloadRefused``, before the model is touched) and a weight sync through the model's own ``load_weights``, and
keeps serving; a copy engine reloads its own copy in place and from a new ``weights_path``, and takes the sync.
Afterwards a fresh zero_copy engine maps the daemon and answers as before: the daemon's memory was never written.
Every process is stopped by its PID.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

pytest.importorskip("vllm")
if importlib.util.find_spec("vllm.model_executor.model_loader.reload") is None:
    pytest.skip("this vLLM has no in-place layerwise reload (vllm.model_executor.model_loader.reload)",
                allow_module_level=True)

from tests.gpu.test_ipc_cache_gpu import Engine as CacheEngine  # noqa: E402
from tests.gpu.test_ipc_cache_gpu import sock, socket_of, start_daemon  # noqa: E402,F401 (sock: a fixture)
from vllm_fastload.ipc.wire.client import status_of  # noqa: E402

CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams
a = json.loads(sys.argv[1])
llm = LLM(model=a["model"], load_format="ipc_cache", enforce_eager=True, skip_tokenizer_init=True,
          max_model_len=512, gpu_memory_utilization=0.25, model_loader_extra_config=a["extra"])
prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 31], [7, 7, 7, 1000], [42])]
def ids():
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, detokenize=False))
    return [list(o.outputs[0].token_ids) for o in outs]
print("RESULT " + json.dumps({"ids": ids()}), flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "gen":
        print("RESULT " + json.dumps({"ids": ids()}), flush=True)
    elif cmd == "sync":
        # an RL trainer's weight sync: the model's own load_weights through collective_rpc, not reload_weights
        def sync(worker, value):
            import torch
            runner = worker.model_runner
            model = runner.get_model() if hasattr(runner, "get_model") else runner.model
            w = model.model.norm.weight
            model.load_weights([("model.norm.weight", torch.full(tuple(w.shape), value, dtype=w.dtype))])
        try:
            llm.collective_rpc(sync, args=(float(arg),))
            out = {"synced": True}
        except Exception as e:
            out = {"synced": False, "error": f"{type(e).__name__}: {e}"}
        out["ids"] = ids()
        print("RESULT " + json.dumps(out), flush=True)
    elif cmd == "reload":
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": arg} if arg else {})
            out = {"reloaded": True}
        except Exception as e:
            out = {"reloaded": False, "error": f"{type(e).__name__}: {e}"}
        out["ids"] = ids()
        print("RESULT " + json.dumps(out), flush=True)
    else:
        break
"""


class Engine(CacheEngine):
    """An ipc_cache ``LLM`` in its own process (:class:`tests.gpu.test_ipc_cache_gpu.Engine` with this file's child):
    RESULT lines; ``gen``, ``reload [PATH]`` and ``sync VALUE`` (the model's own ``load_weights`` of a final norm
    weight of VALUE, through ``collective_rpc``, which pickles the function: tests only) on stdin."""

    def __init__(self, model, extra, log):
        self.log_path = Path(log)
        self.fh = open(self.log_path, "w")
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps({"model": str(model), "extra": extra})],
                                  stdin=subprocess.PIPE, stdout=self.fh, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
        self.seen = 0

    def send(self, line: str) -> dict:
        """Write ``line`` to the child; its next RESULT."""
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.result()


def norm_zeroed(model: Path, out: Path) -> Path:
    """A copy of ``model`` whose ``model.norm.weight`` is zero (in the shard the index assigns it to)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["model.norm.weight"]
    tensors = load_file(str(out / shard))
    tensors["model.norm.weight"].zero_()
    save_file(tensors, str(out / shard), metadata={"format": "pt"})
    return out


def test_zero_copy_refuses_copy_reloads_and_the_daemons_memory_is_unchanged(tiny, sock, tmp_path):
    changed = norm_zeroed(tiny, tmp_path / "norm-zeroed")
    daemon = start_daemon(tiny, sock, tmp_path, "preload")
    engines = []

    def engine(name, **extra):
        e = Engine(tiny, {"socket_dir": str(sock), "fallback": False, **extra}, tmp_path / f"{name}.log")
        engines.append(e)
        return e

    try:
        st0 = status_of(socket_of(sock))
        zc = engine("zc")
        ref = zc.result()["ids"]
        # zero_copy on CUDA: the mapped weights ARE the daemon's memory, so the reload is refused, untouched
        for arg in ("", str(changed)):
            got = zc.send(f"reload {arg}".strip())
            assert not got["reloaded"], got
            assert "would write into the preload daemon's memory" in got["error"] + zc.log()
            assert '"mode": "copy"' in got["error"] + zc.log()
            assert got["ids"] == ref  # still serving the daemon's weights
        # nor may a weight sync through the model's own load_weights write there (reload.guard_direct_loads)
        got = zc.send("sync 0")
        assert not got["synced"], got
        assert "model.load_weights on an ipc_cache zero_copy engine" in got["error"] + zc.log(), got
        assert got["ids"] == ref

        # copy mode: the engine's own clones; in place, from a new path, and back
        cp = engine("copy", mode="copy")
        assert cp.result()["ids"] == ref
        same = cp.send("reload")
        assert same["reloaded"] and same["ids"] == ref, same
        synced = cp.send("sync 0")  # a copy engine's own memory: the sync is written, as with `auto`
        assert synced["synced"] and synced["ids"] != ref, synced
        zeroed = cp.send(f"reload {changed}")
        assert zeroed["reloaded"] and zeroed["ids"] != ref, zeroed
        assert zeroed["ids"] == synced["ids"]  # the synced norm of zeros is the zeroed checkpoint's
        back = cp.send(f"reload {tiny}")
        assert back["reloaded"] and back["ids"] == ref, back
        assert "reload_weights reads the checkpoint from disk with runai_streamer" in cp.log()

        # the daemon's memory was never written: the zero_copy engine and a fresh one answer as before
        assert zc.send("gen")["ids"] == ref
        st = status_of(socket_of(sock))
        assert st.state == "ready" and st.fingerprint == st0.fingerprint and st.bytes == st0.bytes
        fresh = engine("fresh")
        assert fresh.result()["ids"] == ref
        assert "no disk read" in fresh.log()
    finally:
        for e in engines:
            e.stop()
        daemon.stop()
