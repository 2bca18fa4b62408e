"""Fixtures of the GPU tests: random Llama models made on the device (no hub, no carried weights)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """2 layers, ~20 MB (benchmarks/make_model.py --shape tiny)."""
    from make_model import make

    return make(tmp_path_factory.mktemp("tiny") / "tiny-llama", "tiny")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """~0.4 GB: large enough that counting the weights twice or not at all shows in the KV cache size."""
    from make_model import make

    return make(tmp_path_factory.mktemp("small") / "small-llama", "small")
