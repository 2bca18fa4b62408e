"""vLLM's sleep mode with our loaders on CUDA (issue 16, item 2; vLLM's sleep mode runs on CUDA only).

One engine per case with ``enable_sleep_mode=True``: greedy ids, then ``sleep(level=1)`` / ``wake_up()`` and
``sleep(level=2)`` / ``wake_up()``, greedy ids after each wake. Level 2 discards the weights vLLM allocated, so
the engine reloads them (``reload_weights``, the RL loops' flow) except for ``ipc_cache`` zero_copy, whose weights
are the daemon's memory (outside vLLM's sleep allocator: they stay mapped and valid). The child prints the seconds
of each sleep and wake and the device memory freed by sleeping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

pytest.importorskip("vllm")

from tests.gpu.test_ipc_cache_gpu import sock, start_daemon  # noqa: E402,F401 (sock: a fixture)

SLEEPER = r"""
import json, sys, time, torch
from vllm import LLM, SamplingParams
a = json.loads(sys.argv[1])
llm = LLM(model=a["model"], load_format=a["fmt"], enforce_eager=True, skip_tokenizer_init=True, max_model_len=512,
          gpu_memory_utilization=0.3, model_loader_extra_config=a["extra"], enable_sleep_mode=True)
prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 31], [7, 7, 7, 1000], [42])]
def ids():
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, detokenize=False))
    return [list(o.outputs[0].token_ids) for o in outs]
out = {"before": ids()}
for level in (1, 2):
    free0 = torch.cuda.mem_get_info()[0]
    t = time.perf_counter(); llm.sleep(level=level); out[f"sleep{level}_s"] = time.perf_counter() - t
    out[f"freed{level}_bytes"] = torch.cuda.mem_get_info()[0] - free0
    t = time.perf_counter(); llm.wake_up(); out[f"wake{level}_s"] = time.perf_counter() - t
    if level == 2 and a["reload_after_level2"]:
        t = time.perf_counter(); llm.collective_rpc("reload_weights"); out["reload_s"] = time.perf_counter() - t
    out[f"after{level}"] = ids()
print("SLEEP " + json.dumps(out), flush=True)
"""


def sleeper(model, fmt, extra, reload_after_level2, log):
    arg = json.dumps({"model": str(model), "fmt": fmt, "extra": extra,
                      "reload_after_level2": reload_after_level2})
    p = subprocess.run([sys.executable, "-c", SLEEPER, arg], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    text = p.stdout + p.stderr
    Path(log).write_text(text)
    assert p.returncode == 0, text[-4000:]
    return json.loads(text.split("SLEEP ", 1)[1].splitlines()[0]), text


@pytest.mark.parametrize("case", ["runai_streamer", "zero_copy", "copy"])
def test_sleep_and_wake_keep_greedy_ids(tiny, sock, tmp_path, case):
    daemon = None
    if case == "runai_streamer":
        fmt, extra = "runai_streamer", {}
    else:
        daemon = start_daemon(tiny, sock, tmp_path, "preload")
        fmt, extra = "ipc_cache", {"socket_dir": str(sock), "mode": case, "fallback": False}
    try:
        out, log = sleeper(tiny, fmt, extra, reload_after_level2=case != "zero_copy", log=tmp_path / f"{case}.log")
    finally:
        if daemon is not None:
            daemon.stop()
    print(case, {k: v for k, v in out.items() if not k.startswith(("before", "after"))})
    assert out["after1"] == out["before"], log[-3000:]
    assert out["after2"] == out["before"], log[-3000:]
    if case != "runai_streamer":
        assert "Mapped " in log  # mapped from the daemon, not a fallback
