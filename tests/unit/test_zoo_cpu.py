"""The tensor zoo through the CPU path of RunaiStreamerLoader: every tensor bit-exact."""

import pytest
import torch

pytest.importorskip("vllm")

from tests.conftest import write_zoo  # noqa: E402
from tests.unit.test_loader_inprocess import model_config  # noqa: E402
from vllm.config.load import LoadConfig  # noqa: E402
from vllm_fastload.streaming.loader import RunaiStreamerLoader  # noqa: E402


class Collect(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.got = {}

    def load_weights(self, weights):
        for name, t in weights:
            self.got[name] = t  # held past the next step on purpose
        return None


def test_zoo_bit_exact_cpu(tmp_path):
    expected = write_zoo(tmp_path / "model.safetensors")
    m = Collect()
    RunaiStreamerLoader(LoadConfig(load_format="runai_streamer")).load_weights(m, model_config(tmp_path))
    assert set(m.got) == set(expected)
    for name, (dtype, shape, raw) in expected.items():
        t = m.got[name]
        assert t.dtype == dtype and tuple(t.shape) == shape, name
        assert t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() == raw, name
