import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: GPU tests run on the device machine (see docs/gpu.md)", allow_module_level=True)
