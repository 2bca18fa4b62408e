"""Real vLLM on the GPU: our runai_streamer's model bit-identical to built-in auto's and its greedy token ids ones an
``auto`` engine gives (TP=1 and TP=2; auto's own ids differ between processes on an H100, tests/conftest.py)."""

import json

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

pytest.importorskip("vllm")

from tests.conftest import Engine, assert_same_state, greedy_differs  # noqa: E402


def greedy(model, fmt, tp, log, extra=None):
    """The first answer of :class:`tests.conftest.Engine` (greedy ids of its prompts, the model's ``state``) from a
    vLLM engine of ``model`` (load format ``fmt``, TP ``tp``) that must exit 0 afterwards, and its log."""
    e = Engine(model, fmt, tp, extra, log=log)
    try:
        got = e.result()
    finally:
        code = e.stop()
    log = e.log()
    assert code == 0, log[-4000:]
    return got, log


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_ids_equal_auto(tiny, tp, tmp_path):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ref, _ = greedy(tiny, "auto", tp, tmp_path / "auto.log")
    report = tmp_path / "r.json"
    got, log = greedy(tiny, "runai_streamer", tp, tmp_path / "runai.log", {"report_path": str(report)})
    assert_same_state(got["state"], ref["state"])  # per rank, every tensor of the model bit-identical to auto's
    assert greedy_differs(got, ref) is None, greedy_differs(got, ref)
    assert "fastload: runai_streamer loaded" in log
    r = json.loads(report.read_text())
    assert r["format_used"] == "runai_streamer" and r["extra"]["h2d_s"] > 0  # the GPU path ran
