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
from vllm_fastload.content import ContentPin, Hashing, checkpoint_digest, combine, record
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
            shape = ",".join(str(d) for d in spec["shape"])
            per[name] = f"{spec['dtype']}\0{shape}\0".encode() + blake3.blake3(raw[8 + n + b:8 + n + e]).digest()
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
    expected = combine({k: record("F32", v.shape, blake3.blake3(v.numpy().tobytes()).digest())
                        for k, v in kept.items()})
    assert _digest(tmp_path) == expected
    # vLLM's default loader yields both copies of "norm" (the index's last): the model keeps the last one given
    h = Hashing()
    list(h.wrap([("norm", torch.ones(4)), ("x", torch.zeros(2)), ("norm", torch.full((4,), 3.0))]))
    assert h.digest == expected and h.repeated == ["norm"]
    h = Hashing()
    list(h.wrap([("norm", torch.full((4,), 3.0)), ("x", torch.zeros(2)), ("norm", torch.ones(4))]))
    assert h.digest != expected  # the model ended with the copy the index did not choose: a pin fails


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


def test_the_same_bytes_under_another_dtype_or_shape_are_other_weights(tmp_path):
    """The adversarial review's first finding: relabelling a tensor's dtype (BF16 -> F16) or shape in the header
    keeps every data byte; a pin must not pass it."""
    from tests.conftest import write_raw

    data = torch.tensor([1.0, -2.5, 3.0, 0.1]).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    digests = set()
    for dtype, shape in (("BF16", [4]), ("F16", [4]), ("I16", [2, 2]), ("BF16", [2, 2])):
        d = tmp_path / f"{dtype}-{len(shape)}"
        d.mkdir()
        write_raw(d / "model.safetensors", {"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, 8]}}, data)
        digests.add(_digest(d))
        from safetensors.torch import load_file

        h = Hashing()
        list(h.wrap(load_file(str(d / "model.safetensors")).items()))
        assert h.digest == _digest(d) == _by_hand([d / "model.safetensors"])
    assert len(digests) == 4


def test_a_file_changed_after_its_header_was_read_is_not_hashed(tmp_path):
    write_safetensors(tmp_path / "model.safetensors", {"a": torch.ones(64)})
    ck = read_checkpoint(select_shards(str(tmp_path)))
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "model.safetensors") - 20)
    with pytest.raises(CheckpointError, match="changed while it was being inspected"):
        checkpoint_digest(ck)


@pytest.mark.parametrize("cls", [StreamerConfig, IpcCacheConfig])
@pytest.mark.parametrize("bad", ["blake3:abc", "sha256:" + "0" * 64, "blake3:" + "A" * 64, 7,
                                 "blake3:" + "0" * 64 + "\n", " blake3:" + "0" * 64, ""])
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
    with open(tmp_path / "model.safetensors", "ab") as f:  # trailing bytes: a problem, so no digest to pin
        f.write(b"junk")
    r = _cli("inspect", str(tmp_path), "--no-fingerprint", "--content-digest")
    assert r.returncode == 1 and "content digest not computed: the checkpoint has problems" in r.stdout


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
    seen = []
    loader = fall_back("runai_streamer", "a test reason", True, LoadConfig(load_format="runai_streamer"),
                       pin=ContentPin(pinned, str(tmp_path), seen.append))
    if right:
        assert sorted(n for n, _ in loader.get_all_weights(None, None)) == ["a", "b"]
        assert seen == [pinned]
    else:
        with pytest.raises(ContentMismatch, match=str(tmp_path)):
            list(loader.get_all_weights(None, None))
    plain = fall_back("runai_streamer", "a test reason", True, LoadConfig(load_format="runai_streamer"))
    assert len(list(plain.get_all_weights(None, None))) == 2


def test_content_hash_survives_a_fallback_and_a_pinned_reload_leaves_the_model_untouched(tmp_path, monkeypatch):
    """Findings 2 and 4: a .bin-only checkpoint falls back and still reports its digest; a reload (vLLM's
    get_all_weights into a model that serves) with a wrong pin fails before the first tensor is written."""
    pytest.importorskip("vllm")
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from tests.conftest import fake_model_config as model_config
    from tests.unit.test_loader_inprocess import run, tensors
    from vllm_fastload.streaming.loader import RunaiStreamerLoader

    ts = tensors()
    torch.save(ts, tmp_path / "pytorch_model.bin")
    monkeypatch.setattr(DefaultModelLoader, "get_all_weights", lambda self, mc, m: iter(tensors().items()))
    monkeypatch.setattr(DefaultModelLoader, "load_weights",
                        lambda self, model, mc: model.load_weights(self.get_all_weights(mc, model)))
    rep = tmp_path / "r.json"
    sink, _ = run(tmp_path, {"content_hash": True}, report=rep)
    r = json.loads(rep.read_text())
    assert r["format_used"] == "auto" and r["content_digest"].startswith("blake3:")
    h = Hashing()
    list(h.wrap(tensors().items()))
    assert r["content_digest"] == h.digest

    new = tmp_path / "new"
    write_safetensors(new / "model.safetensors", {k: torch.zeros_like(v) for k, v in ts.items()})
    loader = RunaiStreamerLoader(LoadConfig(load_format="runai_streamer",
                                            model_loader_extra_config={"expected_content_digest": h.digest}))
    served = {k: v.clone() for k, v in sink.params.items()}
    with pytest.raises(ContentMismatch, match="not reloading it"):
        sink.load_weights(loader.get_all_weights(model_config(new), sink))
    assert all(torch.equal(sink.params[k], v) for k, v in served.items())


def test_a_mismatch_names_the_digest_to_pin_for_these_files():
    """Issue 27, item 8: the fix in the message is the digest the files have, ready to paste, not the pin again."""
    import torch

    from vllm_fastload.content import Hashing
    from vllm_fastload.errors import ContentMismatch

    h = Hashing()
    list(h.wrap([("w", torch.arange(6, dtype=torch.float32))]))
    pinned = "blake3:" + "0" * 64
    with pytest.raises(ContentMismatch) as e:
        h.check(pinned, "/models/m")
    msg = str(e.value)
    assert h.digest != pinned and f'pin their digest: \'{{"expected_content_digest": "{h.digest}"}}\'' in msg
    assert msg.count(pinned) == 1  # named once, as what was expected


def test_closing_the_hashing_stream_closes_the_stream_inside_at_once():
    def inner():
        yield "a", torch.zeros(4)
        yield "b", torch.ones(4)

    it = inner()
    hashed = Hashing().wrap(it)
    assert next(hashed)[0] == "a"
    hashed.close()
    assert it.gi_frame is None  # closed now, though this test still holds a reference to it
