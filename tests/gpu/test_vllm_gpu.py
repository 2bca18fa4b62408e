"""Real vLLM on the GPU: greedy token ids of our runai_streamer equal built-in auto's (TP=1 and TP=2)."""

import json
import subprocess
import sys

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

pytest.importorskip("vllm")


CHILD = r"""
import json, sys
from vllm import LLM, SamplingParams
a = json.loads(sys.argv[1])
llm = LLM(model=a["model"], load_format=a["fmt"], enforce_eager=True, skip_tokenizer_init=True,
          tensor_parallel_size=a["tp"], max_model_len=512, gpu_memory_utilization=0.3,
          model_loader_extra_config=a["extra"])
prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 200, 31], [7, 7, 7, 1000], [42])]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, detokenize=False))
print("IDS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


def greedy(model, fmt, tp, extra=None, tmp=None):
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"model": str(model), "fmt": fmt, "tp": tp, "extra": extra or {}})],
                       capture_output=True, text=True, timeout=600)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    return json.loads(log.split("IDS ", 1)[1].splitlines()[0]), log


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_ids_equal_auto(tiny, tp, tmp_path):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ref, _ = greedy(tiny, "auto", tp)
    report = tmp_path / "r.json"
    ids, log = greedy(tiny, "runai_streamer", tp, {"report_path": str(report)})
    assert ids == ref
    assert "fastload: runai_streamer loaded" in log
    r = json.loads(report.read_text())
    assert r["format_used"] == "runai_streamer" and r["extra"]["h2d_s"] > 0  # the GPU path ran
