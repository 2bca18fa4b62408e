"""benchmarks/state_diff.py and benchmarks/model_state.py: an engine whose parameters hold auto's bytes under another
class (vLLM's ``ModelWeightParameter`` replaced by a plain ``nn.Parameter``, what `ipc_cache` engines had before
protocol 6) is reported as differing, and the state records each tensor's class and device type."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import state_diff  # noqa: E402
from model_state import STATE_SRC  # noqa: E402


class _Weight(torch.nn.Parameter):
    """A stand-in for one of vLLM's parameter classes."""


def _state_of(model):
    ns = {}
    exec(STATE_SRC, ns)
    worker = type("W", (), {"model_runner": type("R", (), {"model": model})()})()
    return ns["state"](worker)


def _model(cls):
    m = torch.nn.Linear(4, 3, bias=False)
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    m.weight = torch.Tensor._make_subclass(cls, w, False)
    m.register_buffer("scale", torch.ones(1))
    return m


def test_the_state_names_each_tensors_class_and_device_type():
    st = _state_of(_model(_Weight))
    assert st["weight"][0] == "param" and st["weight"][5].endswith("._Weight") and st["weight"][6] == "cpu"
    assert st["scale"][0] == "buffer" and st["scale"][5] == "torch.Tensor" and st["scale"][6] == "cpu"


def test_the_same_bytes_under_another_class_differ():
    ref = {"state": _state_of(_model(_Weight)), "ids": [[1]], "logprobs": [[0.0]]}
    got = {"state": _state_of(_model(torch.nn.Parameter)), "ids": [[1]], "logprobs": [[0.0]]}
    r = state_diff.compare(ref, got)
    assert r["class_differs"] == ["weight"]
    assert r["bytes_differ"] == [] and r["layout_differs"] == []
    assert state_diff.compare(ref, ref)["class_differs"] == []
