import json
import os

import torch

from tests.conftest import demo_plus_overlay, write_raw, write_safetensors
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


def test_inspect_text_counts_one_tensor_and_several_in_plain_words(tmp_path, capsys):
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": torch.ones(4)})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": torch.ones(2), "c": torch.ones(2)})
    assert main(["inspect", str(tmp_path), "--no-fingerprint"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("  model-00001-of-00002.safetensors: 1 tensor, 0.00 GiB, largest a ")
    assert lines[2].startswith("  model-00002-of-00002.safetensors: 2 tensors, 0.00 GiB, largest ")
    # the whole checkpoint (32 bytes) is less than the 1 GiB floor: the limit is the checkpoint, said in bytes
    assert lines[3] == ('suggested runai_streamer extra-config: {"memory_limit": 32, "concurrency": '
                        f'{min(32, 2 * (os.cpu_count() or 8))}}}  (memory_limit 32 bytes)')


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
             str(bins): "found pytorch_model.bin): runai_streamer falls back to vLLM's default loader; convert to "
                        "safetensors"}
    for src, expect in cases.items():
        assert main(["inspect", src, "--no-fingerprint"]) == 1
        out = capsys.readouterr().out
        assert expect in out and "suggested runai_streamer extra-config" not in out, out


def test_no_extra_config_is_suggested_when_no_shard_can_be_read(tmp_path, capsys):
    """Every shard malformed: the problems, and no memory_limit of 0 GiB to tune from (a helper's attack, 2026-12-05);
    one good shard beside a bad one still gets its suggestion."""
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"garbage garbage")
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\x00" * 7)
    assert main(["inspect", str(tmp_path), "--no-fingerprint"]) == 1
    out = capsys.readouterr().out
    assert out.count("PROBLEM") == 2 and "suggested runai_streamer extra-config" not in out, out
    assert main(["inspect", str(tmp_path), "--no-fingerprint", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["suggested"] is None
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"w": torch.ones(4)})
    assert inspect(str(tmp_path), with_fingerprint=False)["suggested"]["memory_limit"] == 16


# --- issue 15: bad input, round 2 (inspect says what the loaders will do, with their messages) ----------------------
def test_inspect_refuses_a_name_in_two_shards_without_index_like_the_loader(demo_model, tmp_path, capsys):
    from vllm_fastload.checkpoint import read_checkpoint, select_shards
    from vllm_fastload.errors import CheckpointError

    d = demo_plus_overlay(demo_model, tmp_path)
    assert main(["inspect", str(d), "--no-fingerprint", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    try:
        read_checkpoint(select_shards(str(d)))
    except CheckpointError as e:
        loader_says = str(e)
    assert rep["problems"] == [loader_says] and "'model.norm.weight' is stored in 2 shards" in loader_says
    assert [s["tensors"] for s in rep["shards"]] == [272, 1]


def test_inspect_warns_about_a_copy_the_index_leaves_out_and_exits_0(tmp_path, capsys):
    s1 = write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": torch.ones(2), "n": torch.zeros(2)})
    s2 = write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": torch.ones(2), "n": torch.ones(2)})
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": {"a": s1.name, "b": s2.name, "n": s2.name}}))
    assert main(["inspect", str(tmp_path), "--no-fingerprint"]) == 0
    out = capsys.readouterr().out
    assert (f"  warning: {s1} also holds 1 tensor(s) that {tmp_path / SAFE_INDEX} assigns to another shard; those "
            f"copies are not loaded: 'n' (loaded from {s2.name})") in out.splitlines()


def test_inspect_reports_shards_without_tensors(tmp_path, capsys):
    write_raw(tmp_path / "model.safetensors", {"__metadata__": {"format": "pt"}}, b"")
    assert main(["inspect", str(tmp_path), "--no-fingerprint", "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["problems"] == [
        f"{tmp_path}: the selected shard(s) hold no tensors (model.safetensors: headers without tensor entries), so "
        f"the model's weights would stay uninitialized; point the load at the directory holding the weights, or "
        f"re-export the checkpoint"]


def test_inspect_refuses_a_zero_element_tensor_inside_another(tmp_path, capsys):
    p = write_raw(tmp_path / "model.safetensors", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                                                   "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}},
                  b"\0" * 16)
    assert main(["inspect", str(tmp_path), "--no-fingerprint", "--json"]) == 1
    [problem] = json.loads(capsys.readouterr().out)["problems"]
    assert problem.startswith(f"{p}: tensor 'z' has zero elements but its data_offsets [8, 8] lie inside tensor 'a'")


def test_inspect_names_a_snapshot_link_to_a_missing_blob(tmp_path, capsys):
    snap = tmp_path / "models--org--m" / "snapshots" / "r1"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to("../../blobs/abc")
    assert main(["inspect", str(snap), "--no-fingerprint"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vllm-fastload inspect: error: {snap}/model.safetensors is a symbolic link to "
                          f"../../blobs/abc ({tmp_path}/models--org--m/blobs/abc), which does not exist")
    assert "incomplete or evicted download" in err


def test_bad_engine_args_fail_the_fingerprint_alone_in_one_line(demo_model, capsys):
    """Engine args vLLM refuses (an unknown flag; a TP size the model's heads do not divide) still give the shard
    report; the fingerprint part is one problem line naming vLLM's reason, not a 250-line usage or a traceback."""
    pytest = __import__("pytest")
    pytest.importorskip("vllm")
    rep = inspect(str(demo_model), ["--bogus-flag", "3"])
    assert rep["shards"][0]["tensors"] == 272 and "fingerprint" not in rep
    assert rep["problems"] == [
        "fingerprint not computed: vLLM rejected the engine args: unrecognized arguments: "
        "--bogus-flag 3 (the shard report above is complete; fix the engine args, or pass --no-fingerprint)"]
    assert main(["inspect", str(demo_model), "--tensor-parallel-size", "2"]) == 1
    out = capsys.readouterr().out
    assert "model.safetensors: 272 tensors" in out
    assert ("PROBLEM (engine args): fingerprint not computed: ValidationError: Total number of attention heads (9) "
            "must be divisible by tensor parallel size (2).") in out
    assert len(out.splitlines()) == 4  # source, shard, problem, suggestion: no vLLM log lines in the report


def test_inspect_json_gives_the_reason_on_stdout_when_it_cannot_inspect(tmp_path, capsys):
    """Exit 2 (cannot inspect): with --json a script reading stdout gets a document naming the error."""
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    assert main(["inspect", str(tmp_path), "--no-fingerprint", "--json"]) == 2
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["source"] == str(tmp_path) and "missing.safetensors" in doc["error"] and doc["error"] in err
