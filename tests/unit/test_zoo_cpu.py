"""The tensor zoo through the CPU path of RunaiStreamerLoader: every tensor bit-exact."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config.load import LoadConfig  # noqa: E402

from tests.conftest import assert_zoo_bit_exact, fake_model_config, write_zoo  # noqa: E402
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
    RunaiStreamerLoader(LoadConfig(load_format="runai_streamer")).load_weights(m, fake_model_config(tmp_path))
    assert_zoo_bit_exact(m.got, expected)


def test_held_tensor_keeps_its_values_under_the_smallest_memory_limit(tmp_path):
    """A weight, a 1 MB filler, then its scale, with memory_limit 0 (runai's ring = the largest tensor): the
    weight the consumer holds past the next steps still has its own values (owned tensors on CPU)."""
    from tests.conftest import write_safetensors

    g = torch.Generator().manual_seed(3)
    ts = {"a.weight": torch.randn(64, 64, generator=g), "b.filler": torch.randn(2**18, generator=g),
          "c.scale": torch.randn(1, generator=g)}
    write_safetensors(tmp_path / "model.safetensors", ts)
    m = Collect()
    RunaiStreamerLoader(LoadConfig(load_format="runai_streamer", model_loader_extra_config={"memory_limit": 0})) \
        .load_weights(m, fake_model_config(tmp_path))
    for k, v in ts.items():
        assert torch.equal(m.got[k], v), k
