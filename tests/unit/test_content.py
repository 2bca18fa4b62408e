"""The content digest (issue 15, item 7): what it is, who computes it, what it sees that the fingerprint cannot."""

import json
import os
import subprocess
import sys

import blake3
import pytest
import torch

from tests.conftest import fake_model_config, write_safetensors, write_zoo
from vllm_fastload.checkpoint import read_checkpoint, read_header, select_shards
from vllm_fastload.config import IpcCacheConfig, StreamerConfig
from vllm_fastload.content import Hashing, checkpoint_digest, combine
from vllm_fastload.errors import CheckpointError, ConfigError, ContentMismatch


def _by_hand(files) -> str:
    """The digest as the docs define it, computed from the raw file bytes without the package's code."""
    per = {}
    for p in files:
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        for name, spec in json.loads(raw[8:8 + n]).items():
            if name == "__metadata__":
                continue
            b, e = spec["data_offsets"]
            per[name] = blake3.blake3(raw[8 + n + b:8 + n + e]).digest()
    h = blake3.blake3()
    for name in sorted(per):
        h.update(name.encode() + b"\0" + per[name])
    return "blake3:" + h.hexdigest()


def _digest(path) -> str:
    return checkpoint_digest(read_checkpoint(select_shards(str(path))))


def test_checkpoint_digest_follows_the_definition_over_two_shards_and_every_dtype(tmp_path):
    write_zoo(tmp_path / "model-00001-of-00002.safetensors")
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"z.weight": torch.arange(12.0).reshape(3, 4)})
    files = sorted(tmp_path.glob("*.safetensors"))
    assert _digest(tmp_path) == _by_hand(files)


def test_in_place_rewrite_with_restored_mtime_is_invisible_to_the_fingerprint_but_not_to_the_digest(tmp_path):
    """`cp -p` of a fine-tune over the base file: same inode, same header, same size, mtime restored."""
    pytest.importorskip("vllm")
    from vllm_fastload.fingerprint import of_model

    p = write_safetensors(tmp_path / "model.safetensors", {"norm": torch.ones(8), "w": torch.ones(4, 4)})
    mc = fake_model_config(tmp_path)
    st = p.stat()
    fp_before, digest_before = of_model(mc)[1], _digest(tmp_path)
    header_len = int.from_bytes(p.read_bytes()[:8], "little")
    with open(p, "r+b") as f:
        f.seek(8 + header_len + read_header(str(p)).tensors["norm"].begin)
        f.write(b"\0" * 32)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert p.stat().st_ino == st.st_ino and p.stat().st_mtime_ns == st.st_mtime_ns
    assert of_model(mc)[1] == fp_before  # identity level: blind to this
    assert _digest(tmp_path) == _by_hand([p]) != digest_before


def test_index_assigned_duplicates_are_left_out_as_the_loaders_leave_them_out(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"norm": torch.ones(4), "x": torch.zeros(2)})
    write_safetensors(tmp_path / "b.safetensors", {"norm": torch.full((4,), 3.0)})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"norm": "b.safetensors", "x": "a.safetensors"}}))
    kept = {"norm": torch.full((4,), 3.0), "x": torch.zeros(2)}
    expected = combine({k: blake3.blake3(v.numpy().tobytes()).digest() for k, v in kept.items()})
    assert _digest(tmp_path) == expected


def test_hashing_a_cpu_stream_gives_the_files_digest_and_passes_every_tensor_through(tmp_path):
    zoo = write_zoo(tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "model.safetensors"))
    h = Hashing()
    out = list(h.wrap(loaded.items()))
    assert [n for n, _ in out] == list(loaded) and all(a is loaded[n] for n, a in out)
    assert h.digest == _digest(tmp_path)
    assert h.bytes == sum(len(raw) for _, _, raw in zoo.values())
    h.check(h.digest, "here")
    wrong = "blake3:" + "0" * 64
    with pytest.raises(ContentMismatch) as e:
        h.check(wrong, str(tmp_path))
    assert h.digest in str(e.value) and wrong in str(e.value) and str(tmp_path) in str(e.value)
    assert "expected_content_digest" in str(e.value)


def test_a_name_twice_in_a_stream_is_an_error():
    t = torch.ones(2)
    with pytest.raises(CheckpointError, match="'a' came twice"):
        list(Hashing().wrap([("a", t), ("a", t)]))


@pytest.mark.parametrize("cls", [StreamerConfig, IpcCacheConfig])
@pytest.mark.parametrize("bad", ["blake3:abc", "sha256:" + "0" * 64, "blake3:" + "A" * 64, 7])
def test_a_malformed_pinned_digest_is_refused_naming_the_key(cls, bad):
    with pytest.raises(ConfigError) as e:
        cls.from_extra({"expected_content_digest": bad})
    assert "'expected_content_digest'" in str(e.value) and "64 lowercase hex digits" in str(e.value)


def test_config_hashes_content_when_asked_or_pinned():
    assert not StreamerConfig.from_extra({}).hashes_content
    assert StreamerConfig.from_extra({"content_hash": True}).hashes_content
    assert StreamerConfig.from_extra({"expected_content_digest": "blake3:" + "a" * 64}).hashes_content


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "vllm_fastload.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_inspect_prints_the_digest_and_refuses_object_storage_content_digests(tmp_path):
    write_zoo(tmp_path / "model.safetensors")
    r = _cli("inspect", str(tmp_path), "--no-fingerprint", "--content-digest", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["content_digest"] == _by_hand([tmp_path / "model.safetensors"])
    r = _cli("inspect", str(tmp_path), "--no-fingerprint", "--content-digest")
    assert f"content digest {_by_hand([tmp_path / 'model.safetensors'])}" in r.stdout
    r = _cli("inspect", str(tmp_path), "--no-fingerprint")
    assert "content digest" not in r.stdout


def test_object_storage_digest_is_refused_with_the_way_out(tmp_path):
    from vllm_fastload.checkpoint import Checkpoint, ShardPlan

    h = read_header(str(write_safetensors(tmp_path / "m.safetensors", {"a": torch.ones(1)})))
    import dataclasses

    remote = dataclasses.replace(h, path="s3://bucket/m.safetensors")
    ck = Checkpoint(ShardPlan("s3://bucket", ("s3://bucket/m.safetensors",)), (remote,))
    with pytest.raises(CheckpointError, match="content_hash"):
        checkpoint_digest(ck)


def test_runai_streamer_reports_the_digest_and_fails_a_load_whose_bytes_differ_from_the_pin(tmp_path, caplog):
    pytest.importorskip("vllm")
    from tests.unit.test_loader_inprocess import run

    write_safetensors(tmp_path / "model.safetensors", {k: v for k, v in _sink_tensors().items()})
    pinned = _digest(tmp_path)
    rep = tmp_path / "report.json"
    sink, ts = run(tmp_path, {"content_hash": True}, report=rep)
    assert json.loads(rep.read_text())["content_digest"] == pinned
    assert all(torch.equal(sink.seen[k], v) for k, v in ts.items())
    run(tmp_path, {"expected_content_digest": pinned})
    other = "blake3:" + "1" * 64
    with pytest.raises(ContentMismatch) as e:
        run(tmp_path, {"expected_content_digest": other, "fallback": True})
    assert pinned in str(e.value) and other in str(e.value)
    rep2 = tmp_path / "plain.json"
    run(tmp_path, {}, report=rep2)
    assert json.loads(rep2.read_text())["content_digest"] is None


def _sink_tensors():
    from tests.unit.test_loader_inprocess import tensors

    return tensors()


@pytest.mark.parametrize("right", [True, False])
def test_a_fallback_load_is_checked_against_the_pin(tmp_path, monkeypatch, right):
    pytest.importorskip("vllm")
    import inspect

    from safetensors.torch import load_file
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from vllm_fastload.fallback import fall_back

    # pin_loader relies on this: the default loader's load_weights streams through self.get_all_weights
    assert "self.get_all_weights(" in inspect.getsource(DefaultModelLoader.load_weights)
    write_safetensors(tmp_path / "model.safetensors", {"a": torch.ones(3), "b": torch.arange(4)})
    pinned = _digest(tmp_path) if right else "blake3:" + "2" * 64
    monkeypatch.setattr(DefaultModelLoader, "get_all_weights",
                        lambda self, mc, m: iter(load_file(str(tmp_path / "model.safetensors")).items()))
    loader = fall_back("runai_streamer", "a test reason", True, LoadConfig(load_format="runai_streamer"),
                       expected_content_digest=pinned, source=str(tmp_path))
    if right:
        assert sorted(n for n, _ in loader.get_all_weights(None, None)) == ["a", "b"]
    else:
        with pytest.raises(ContentMismatch, match=str(tmp_path)):
            list(loader.get_all_weights(None, None))
    plain = fall_back("runai_streamer", "a test reason", True, LoadConfig(load_format="runai_streamer"))
    assert len(list(plain.get_all_weights(None, None))) == 2
