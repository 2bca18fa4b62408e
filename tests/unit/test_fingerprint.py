import dataclasses

from vllm_fastload.fingerprint import Fingerprint, ShardFacts


def fp(**kw):
    base = dict(
        shards=(ShardFacts("b.safetensors", 20, "bb"), ShardFacts("a.safetensors", 10, "aa")),
        architecture="LlamaForCausalLM", dtype="bfloat16", quantization=None, rope='{"rope_theta": 10000}',
        revision=None, kv_cache_dtype="auto", tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, dp_size=1, dp_rank=0,
        vllm_version="0.32.0",
    )
    base.update(kw)
    return Fingerprint(**base)


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


def test_shard_change_names_the_shard():
    a = fp()
    b = fp(shards=(ShardFacts("a.safetensors", 10, "aa"), ShardFacts("b.safetensors", 20, "changed")))
    assert a.mismatched_fields(b) == [("shards", ["b.safetensors"], ["b.safetensors"])]


def test_every_field_participates():
    a = fp()
    for f in dataclasses.fields(Fingerprint):
        if f.name == "shards":
            continue
        v = getattr(a, f.name)
        other = dataclasses.replace(a, **{f.name: (v + 1) if isinstance(v, int) else f"{v}x"})
        assert [m[0] for m in a.mismatched_fields(other)] == [f.name]
