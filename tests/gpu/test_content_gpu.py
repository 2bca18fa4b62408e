"""The content digest on a GPU (issue 15, item 7): CUDA tensors are hashed through pinned pieces and give the same
digest as the files; needs only torch with CUDA (no vLLM)."""

import pytest
import torch

from tests.gpu.conftest import NO_CUDA

if not torch.cuda.is_available():
    pytest.skip(NO_CUDA, allow_module_level=True)

from tests.conftest import write_safetensors, write_zoo  # noqa: E402
from vllm_fastload import content  # noqa: E402
from vllm_fastload.checkpoint import read_checkpoint, select_shards  # noqa: E402


def test_cuda_tensors_hash_like_the_files_across_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(content, "PIECE_BYTES", 4096)  # the zoo's big tensor then spans many pieces
    write_zoo(tmp_path / "model-00001-of-00002.safetensors")
    g = torch.Generator().manual_seed(1)
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                      {"large": torch.randn(3, 5000, generator=g).to(torch.bfloat16)})
    ck = read_checkpoint(select_shards(str(tmp_path)))
    from safetensors.torch import load_file

    on_gpu = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        on_gpu.update({k: v.cuda() for k, v in load_file(str(f)).items()})
    h = content.Hashing()
    out = list(h.wrap(on_gpu.items()))
    assert all(t.is_cuda for _, t in out) and len(out) == len(on_gpu)
    assert h.digest == content.checkpoint_digest(ck)
