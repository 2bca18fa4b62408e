import dataclasses
import functools
import os

import pytest
import torch

from tests.conftest import fake_model_config, make_fingerprint, write_safetensors
from vllm_fastload.checkpoint import read_header
from vllm_fastload.fingerprint import Fingerprint, ShardFacts

#: two shards (given out of order), a Llama with RoPE settings; keywords replace fields
fp = functools.partial(make_fingerprint,
                       shards=(ShardFacts(name="b.safetensors", size=20, header_sha256="bb"),
                               ShardFacts(name="a.safetensors", size=10, header_sha256="aa")),
                       architecture="LlamaForCausalLM", rope='{"rope_theta": 10000}', vllm_version="0.32.0")


def test_stable_and_order_independent():
    a = fp()
    b = fp(shards=tuple(reversed(a.shards)))
    assert a.digest() == b.digest() and a.short() == b.short() and len(a.short()) == 12
    assert a.mismatched_fields(b) == []
    assert Fingerprint.from_dict(a.to_dict()) == a


def test_mismatch_lists_fields_with_both_values():
    a, b = fp(), fp(dtype="float16", tp_size=2, tp_rank=1)
    assert a.mismatched_fields(b) == [("dtype", "bfloat16", "float16"), ("tp_size", 1, 2), ("tp_rank", 0, 1)]
    assert "dtype: 'bfloat16' != 'float16'" in a.explain(b)
    assert a.digest() != b.digest()


def test_shard_change_names_the_shard_and_the_fact():
    a = fp()
    b = fp(shards=(ShardFacts(name="a.safetensors", size=10, header_sha256="aa"),
                   ShardFacts(name="b.safetensors", size=20, header_sha256="changed")))
    assert a.mismatched_fields(b) == [("shards", ["b.safetensors (header_sha256='bb')"],
                                       ["b.safetensors (header_sha256='changed')"])]
    c = fp(shards=(ShardFacts(name="a.safetensors", size=10, header_sha256="aa"),))
    assert a.mismatched_fields(c) == [("shards", ["b.safetensors"], [])]


def _fingerprint(path):
    pytest.importorskip("vllm")
    from vllm_fastload.fingerprint import of_model

    return of_model(fake_model_config(path))[1]


def test_values_written_over_the_files_change_the_fingerprint(tmp_path):
    """Issue 15, item 7: identical headers, other tensor values (a norm weight zeroed in place; a fine-tune
    written over the base model's file) give another fingerprint, and the mismatch names the shard and the facts."""
    p = write_safetensors(tmp_path / "model.safetensors", {"norm": torch.ones(8), "w": torch.ones(4, 4)})
    base = _fingerprint(tmp_path)
    st = p.stat()
    facts = base.shards[0]
    assert ((facts.size, facts.mtime_ns, facts.st_dev, facts.st_ino)
            == (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino))
    header_len = int.from_bytes(p.read_bytes()[:8], "little")
    with open(p, "r+b") as f:  # zero the norm weight in place: same inode, same header, new mtime
        data_start = 8 + header_len
        f.seek(data_start + read_header(str(p)).tensors["norm"].begin)
        f.write(b"\0" * 32)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # coarse-mtime file systems: make it visible
    zeroed = _fingerprint(tmp_path)
    assert zeroed.shards[0].header_sha256 == facts.header_sha256 and zeroed.digest() != base.digest()
    (field, mine, theirs), = zeroed.mismatched_fields(base)
    assert (field, mine, theirs) == ("shards", [f"model.safetensors (mtime_ns={st.st_mtime_ns + 1_000_000})"],
                                     [f"model.safetensors (mtime_ns={st.st_mtime_ns})"])
    # a fine-tune saved over the base: a new file under the same name (new inode), same header
    tuned = tmp_path / "tuned.tmp"
    write_safetensors(tuned, {"norm": torch.full((8,), 2.0), "w": torch.ones(4, 4)})
    os.replace(tuned, p)
    replaced = _fingerprint(tmp_path)
    assert replaced.shards[0].header_sha256 == facts.header_sha256
    assert replaced.shards[0].st_ino == p.stat().st_ino and replaced.digest() != zeroed.digest()
    # nothing changed: the same fingerprint
    assert _fingerprint(tmp_path) == replaced


def test_old_fingerprint_dicts_still_parse():
    """A daemon of the previous version sends shards without identity fields: parsed, and unequal to ours."""
    a = fp(shards=(ShardFacts(name="a.safetensors", size=10, header_sha256="aa", mtime_ns=1, st_dev=2, st_ino=3),))
    old = a.to_dict()
    old["shards"] = [{"name": "a.safetensors", "size": 10, "header_sha256": "aa"}]
    b = Fingerprint.from_dict(old)
    assert b.shards[0].mtime_ns is None and a.mismatched_fields(b) == [
        ("shards", ["a.safetensors (mtime_ns=1, st_dev=2, st_ino=3)"],
         ["a.safetensors (mtime_ns=None, st_dev=None, st_ino=None)"])]


def test_every_field_participates():
    a = fp()
    for f in dataclasses.fields(Fingerprint):
        if f.name == "shards":
            continue
        v = getattr(a, f.name)
        other = dataclasses.replace(a, **{f.name: (v + 1) if isinstance(v, int) else f"{v}x"})
        assert [m[0] for m in a.mismatched_fields(other)] == [f.name]


def test_a_config_json_changed_after_the_daemon_loaded_is_a_mismatch(tmp_path):
    """Adversarial pass 2026-12-02: ``tie_word_embeddings`` flipped in config.json between the daemon's start and
    the engine's left the fingerprint equal, so the daemon's tensors were mapped into a skeleton built from another
    config. The bytes of config.json are now part of the fingerprint; a folder without one (or object storage)
    has None there."""
    write_safetensors(tmp_path / "model.safetensors", {"w": torch.ones(4)})
    assert _fingerprint(tmp_path).config_sha256 is None
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')
    before = _fingerprint(tmp_path)
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    after = _fingerprint(tmp_path)
    [(field, mine, theirs)] = after.mismatched_fields(before)
    assert field == "config_sha256" and mine != theirs and len(mine) == 64
