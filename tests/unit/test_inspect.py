import json

import torch

from tests.conftest import write_raw, write_safetensors
from vllm_fastload.checkpoint import SAFE_INDEX
from vllm_fastload.cli import main
from vllm_fastload.inspect import inspect


def test_inspect_reports_shards_alignment_and_suggestions(tmp_path):
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": torch.ones(256, 1024)})
    # hand-written: a 3-byte U8 first, so the F32 after it sits at an unaligned offset
    write_raw(tmp_path / "model-00002-of-00002.safetensors",
              {"u": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
               "f": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}}, b"\1" * 11, pad_to=8 * 4)
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "u": "model-00002-of-00002.safetensors"}}))
    rep = inspect(str(tmp_path), with_fingerprint=False)
    s1, s2 = rep["shards"]
    assert (s1["tensors"], s1["bytes"], s1["largest_tensor"], s1["largest_mib"]) == (1, 2**20, "a", 1.0)
    assert s2["dtypes"] == {"F32": 1, "U8": 1} and s2["unaligned_tensors"] == 1 and s2["unaligned_examples"] == ["f"]
    assert rep["problems"] == [] and rep["suggested"]["memory_limit"] == 2**20 + 11


def test_inspect_cli_names_a_broken_shard_and_exits_1(tmp_path, capsys):
    p = write_safetensors(tmp_path / "model.safetensors", {"a": torch.ones(4)})
    with open(p, "ab") as f:
        f.write(b"junk")
    assert main(["inspect", str(tmp_path), "--no-fingerprint", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert "4 bytes of trailing data" in rep["problems"][0] and str(p) in rep["problems"][0]


def test_inspect_says_why_there_is_nothing_to_stream(tmp_path, capsys):
    """A missing path, an empty directory and a .bin-only directory each get their own problem and fix, and no
    meaningless extra-config suggestion."""
    empty = tmp_path / "empty"
    empty.mkdir()
    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "pytorch_model.bin").write_bytes(b"x")
    (bins / "config.json").write_text("{}")
    cases = {str(tmp_path / "nope"): "does not exist: pass the model directory",
             str(empty): "is empty: no weights to load",
             str(bins): "found pytorch_model.bin): runai_streamer falls back to vLLM's default loader; convert to safetensors"}
    for src, expect in cases.items():
        assert main(["inspect", src, "--no-fingerprint"]) == 1
        out = capsys.readouterr().out
        assert expect in out and "suggested runai_streamer extra-config" not in out, out
