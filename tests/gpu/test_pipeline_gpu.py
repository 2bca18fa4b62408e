"""The GPU read paths on a real GPU: bit-exact tensor zoo (pinned ring and direct pinned reads), held tensors."""

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

pytest.importorskip("vllm")

from vllm.config.load import LoadConfig  # noqa: E402

from tests.conftest import assert_zoo_bit_exact, fake_model_config, write_zoo  # noqa: E402
from vllm_fastload.streaming.loader import RunaiStreamerLoader  # noqa: E402
from vllm_fastload.streaming.pipeline import H2DPipeline  # noqa: E402


class CollectOnGpu(torch.nn.Module):
    """Has a CUDA parameter (so the loader takes the GPU path); holds every yielded tensor."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1, device="cuda"), requires_grad=False)
        self.got = {}

    def load_weights(self, weights):
        for name, t in weights:
            assert t.device.type == "cuda", name
            self.got[name] = t
            torch.cuda._sleep(1000)  # a slow consumer: copies must not be overtaken
        return None


@pytest.mark.parametrize("pinned_slot_bytes, pinned_reader, pipeline_thread", [
    (4096, False, False), (64 * 2**20, False, False), (4096, False, True),  # copy through the pinned ring
    (4096, True, False), (5000, True, False), (64 * 2**20, True, False)])  # read into pinned slots, in pieces
def test_zoo_bit_exact_on_gpu(tmp_path, pinned_slot_bytes, pinned_reader, pipeline_thread):
    expected = write_zoo(tmp_path / "model.safetensors")
    m = CollectOnGpu()
    extra = {"pinned_slot_bytes": pinned_slot_bytes, "pinned_slots": 2, "report_path": str(tmp_path / "r.json"),
             "pinned_reader": pinned_reader, "pipeline_thread": pipeline_thread}
    RunaiStreamerLoader(LoadConfig(load_format="runai_streamer", model_loader_extra_config=extra)).load_weights(
        m, fake_model_config(tmp_path))
    torch.cuda.synchronize()
    assert_zoo_bit_exact(m.got, expected)
    import json

    extra = json.loads((tmp_path / "r.json").read_text())["extra"]
    assert extra["read_ring_pinned"] is pinned_reader
    # the stages of each path, as StageTimes.feed reports them: the ring's host memcpy and hand-over only there
    assert {"slot_wait_s", "h2d_s"} <= set(extra)
    ring_only = {"memcpy_s", "consumer_wait_s"}
    assert ring_only & set(extra) == (set() if pinned_reader else ring_only)
    if pinned_reader:  # runai's ring was recycled within the arena: no pinned memory beyond it
        assert extra["pinned_extra_bytes"] == 0 and extra["pinned_bytes"] > 0


def test_held_tensor_keeps_its_values_under_a_tight_ring():
    """A weight, a 1 MB filler, then its scale, with a 2 x 4 KiB ring: the held weight is unchanged."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 64, generator=g)
    filler = torch.randn(2**18, generator=g)
    scale = torch.randn(1, generator=g)
    with H2DPipeline(torch.device("cuda"), pinned_slot_bytes=4096, pinned_slots=2, copy_threads=1,
                     pipeline_thread=True) as pipe:
        out = dict(pipe.run(iter([("w", weight.clone()), ("filler", filler.clone()), ("scale", scale.clone())])))
    torch.cuda.synchronize()
    assert torch.equal(out["w"].cpu(), weight)
    assert torch.equal(out["filler"].cpu(), filler)
    assert torch.equal(out["scale"].cpu(), scale)
    assert pipe.ring is None and pipe.times.bytes == (weight.numel() + filler.numel() + 1) * 4


def test_pipeline_refuses_a_one_slot_ring():
    with pytest.raises(ValueError, match="pinned_slots >= 2"):
        H2DPipeline(torch.device("cuda"), pinned_slot_bytes=4096, pinned_slots=1)
