"""The fan-out on CUDA without vLLM: each rank reads its share of the tensor zoo through the pinned direct path into
its GPU and the group broadcasts the rest. With two GPUs the tensors cross over NCCL (one GPU per rank, as vLLM
runs TP=2); with one GPU two ranks share it and the tensors cross over gloo (NCCL refuses two ranks on one GPU):
the direct reader's subset reads, the CUDA stream ordering and the byte-exact delivery are the same."""

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

pytest.importorskip("runai_model_streamer")

from tests.conftest import write_zoo, zoo_digests  # noqa: E402
from tests.unit.fanout_worker import run_ranks  # noqa: E402


@pytest.mark.parametrize("piece", [4096, 2**20])
def test_zoo_bit_exact_through_fanout_on_cuda(tmp_path, piece):
    expected = write_zoo(tmp_path / "a.safetensors", seed=3)
    two = torch.cuda.device_count() >= 2
    res = run_ranks(tmp_path, [str(tmp_path / "a.safetensors")], 2, 2, ["h", "h"], device="cuda",
                    gpus=[0, 1] if two else [0, 0], data_backend="nccl" if two else "gloo", piece=piece,
                    distributed=True)
    total = sum(len(raw) for _, _, raw in expected.values())
    want = zoo_digests(expected)
    for r in res:
        assert "error" not in r and r.get("fan"), r
        assert {n: g[0] for n, g in r["tensors"].items()} == want
        assert r["fan"]["read_bytes"] + r["fan"]["received_bytes"] == total
    assert sum(r["fan"]["read_bytes"] for r in res) == total
