"""benchmarks/make_model.py: a model already in the directory is kept only when it has the asked shape (a benchmark
must not measure another model than the one it names)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from make_model import SHAPES, make  # noqa: E402


def test_a_model_of_another_shape_is_refused_not_reused(tmp_path):
    out = make(tmp_path / "m", "tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == SHAPES["tiny"]["num_hidden_layers"]
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) == SHAPES["tiny"]["shards"]
    mtimes = [p.stat().st_mtime_ns for p in sorted(out.glob("*.safetensors"))]
    assert make(out, "tiny") == out  # the same shape: kept, not written again
    assert [p.stat().st_mtime_ns for p in sorted(out.glob("*.safetensors"))] == mtimes
    with pytest.raises(ValueError, match=r"m holds a model of another shape than 'small' \(hidden_size: 256 there, "
                                         r"1024 asked\)"):
        make(out, "small")
    (out / "config.json").unlink()  # an index without a config: not a model this script finished
    with pytest.raises(ValueError, match="hidden_size: None there"):
        make(out, "tiny")
