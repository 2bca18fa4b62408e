"""The constructor's small tensors (``torch.tensor(value)`` in a layer's ``__init__``: vLLM's attention scales,
``kv_cache``): made for real in the engine's skeleton, left out of the daemon's export while they are still as
built (:mod:`vllm_fastload.ipc.memory.constructed`), and the engine's model ends equal to the daemon's."""

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402

from vllm_fastload.ipc.memory.constructed import (  # noqa: E402
    SMALL_NUMEL,
    AsBuilt,
    ConstructionMismatch,
    SmallOnDevice,
    check,
)
from vllm_fastload.ipc.memory.state import (  # noqa: E402
    NotExportable,
    audit,
    collect,
    install,
    object_states,
    reprocess_modules,
    snapshot,
)


class Holder:
    """A vLLM-like object (its module name starts with vllm) holding a tensor the constructor made."""

    __module__ = "vllm.model_executor.toy"

    def __init__(self, t):
        self.t = t


class Attn(nn.Module):
    """What vLLM's attention layer makes at construction (set_default_quant_scales), and one weight."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 3), requires_grad=False)
        self.register_buffer("_k_scale", torch.tensor(1.0, dtype=torch.float32))
        self.register_buffer("_v_scale", torch.tensor(1.0, dtype=torch.float32))
        self._k_scale_cpu = torch.tensor(1.0, dtype=torch.float32)
        self._gone = torch.tensor(2.0)
        self.kv_cache = torch.tensor([])
        self.big = torch.tensor([0.5] * (SMALL_NUMEL + 1))  # not small: on meta in the skeleton
        self.holder = Holder(torch.tensor(3.0))


def daemon(post, cls=Attn, process=False):
    """The daemon's side: build under the rule, load (random weights), snapshot, ``post`` (post-processing), and
    with ``process`` the quant methods' post-processing first; returns the model, the export and the record."""
    torch.manual_seed(0)
    with torch.device("cpu"), SmallOnDevice("cpu") as small:
        m = cls()
    as_built = AsBuilt.of(m, small)
    constructed = object_states(m)
    for p in m.parameters():
        p.data.normal_()
    snap = snapshot(m)
    before = as_built.unchanged(as_built.lookup_tables(snap.tensors))
    if process:
        for mod in m.modules():
            qm = getattr(mod, "quant_method", None)
            if isinstance(qm, QuantizeMethodBase):
                qm.process_weights_after_loading(mod)
    post(m)
    return m, collect(m, snap, constructed, None, as_built, before), as_built


def engine(exp, as_built, cls=Attn):
    """The engine's side: the skeleton on meta with the small tensors real, the digest checked, clones of the
    exported tensors installed (as views of the daemon's segment are), the audit."""
    with torch.device("meta"), SmallOnDevice("cpu") as small:
        eng = cls()
    check(as_built.digest, small.digest(), "test.sock")
    tensors = {k: (kind, t.detach().clone()) for k, (kind, t) in exp.tensors.items()}
    done = install(eng, tensors, exp.aliases, exp.reprocess, exp.attrs, exp.object_attrs, made=small.made,
                   dropped=exp.dropped)
    return eng, done


def test_the_skeleton_makes_small_tensors_for_real_and_the_rest_on_meta():
    with torch.device("meta"), SmallOnDevice("cpu") as small:
        m = Attn()
        explicit = torch.tensor(1.0, device="meta")
        empty = torch.empty(2)
    assert m._k_scale.device.type == "cpu" and float(m._k_scale) == 1.0
    assert m.kv_cache.device.type == "cpu" and m.kv_cache.numel() == 0
    assert m.big.is_meta and m.w.is_meta and explicit.is_meta and empty.is_meta
    assert len(small.made) == 6 and small.digest().startswith("6:")  # 2 buffers, 3 attributes, the holder's


def test_unchanged_small_tensors_stay_out_of_the_export_and_the_engine_ends_equal():
    def post(m):
        m._v_scale.fill_(0.5)  # what a checkpoint's KV scale does
        del m._gone  # what post-processing may remove

    m, exp, as_built = daemon(post)
    assert set(exp.tensors) == {"w", "_v_scale", "big"}
    assert exp.kept == 3 and exp.dropped == ["_gone"]  # _k_scale, _k_scale_cpu, kv_cache stay the engine's own
    eng, done = engine(exp, as_built)
    v_scale = eng._v_scale
    audit(eng, exp.objects, done)
    assert eng._v_scale is v_scale and float(eng._v_scale) == 0.5  # taken over in place: references still see it
    assert not hasattr(eng, "_gone")
    for name in ("w", "_k_scale", "_v_scale", "_k_scale_cpu", "kv_cache", "big"):
        a, b = getattr(m, name), getattr(eng, name)
        assert (a.dtype, a.shape, a.device.type) == (b.dtype, b.shape, b.device.type) and torch.equal(a, b), name
    assert float(eng.holder.t) == 3.0  # a vLLM object's constant: real, not a meta tensor the audit refuses


def test_an_unchanged_small_tensor_that_another_name_aliases_is_exported():
    def post(m):
        m.scale_ref = m._k_scale

    m, exp, as_built = daemon(post)
    assert "_k_scale" in exp.tensors and exp.aliases.get("scale_ref") == "_k_scale"
    eng, done = engine(exp, as_built)
    audit(eng, exp.objects, done)
    assert eng.scale_ref is eng._k_scale


def test_a_changed_small_tensor_only_a_vllm_object_holds_is_refused_by_the_daemon():
    def post(m):
        m.holder.t.fill_(4.0)

    with pytest.raises(NotExportable, match=r"holder\.t refers to a small tensor the model's constructor made"):
        daemon(post)


def test_a_digest_mismatch_names_both_sides():
    with torch.device("meta"), SmallOnDevice("cpu") as a:
        torch.tensor(1.0)
    with torch.device("meta"), SmallOnDevice("cpu") as b:
        torch.tensor(2.0)
    assert a.digest() != b.digest() and a.digest().split(":")[0] == b.digest().split(":")[0] == "1"
    check(a.digest(), a.digest(), "x.sock")
    with pytest.raises(ConstructionMismatch, match=r"count:digest 1:.*than the daemon's at x\.sock \(1:"):
        check(a.digest(), b.digest(), "x.sock")


class Kernel:
    def __init__(self, w):
        self.w = w


class ScaleMethod(QuantizeMethodBase):
    """Post-processing that writes the layer's constant scale in place and binds a kernel object: a re-processed
    unit, whose engine starts from the scale as loaded."""

    def create_weights(self, *a, **k):
        pass

    def apply(self, layer, x):
        return x

    def process_weights_after_loading(self, layer):
        layer._k_scale.mul_(layer.w.abs().max())
        layer.kernel = Kernel(layer.w)


class Quantized(Attn):
    def __init__(self):
        super().__init__()
        self.quant_method = ScaleMethod()


def test_a_reprocessed_unit_keeps_its_constructed_scale_and_reprocessing_gives_the_daemons():
    m, exp, as_built = daemon(lambda m: None, Quantized, process=True)
    assert exp.reprocess == [""]  # the model is the layer that owns the quant method here
    assert "_k_scale" not in exp.tensors  # as built before post-processing: the engine's own
    eng, done = engine(exp, as_built, Quantized)
    reprocess_modules(eng, exp.reprocess, model_config=None)
    audit(eng, exp.objects, done)
    assert torch.equal(eng._k_scale, m._k_scale) and float(m._k_scale) != 1.0


def test_state_differences_name_the_tensor_and_the_field():
    """The GPU tests' state comparison (tests/conftest.py) says which tensor and which field differ."""
    from tests.conftest import state_differences

    ref = [{"a": ["buffer", "torch.float32", [], [], "s1", "torch.Tensor", "cpu"], "b": ["param"] * 7}]
    got = [{"a": ["buffer", "torch.float32", [], [], "s1", "torch.Tensor", "cuda"], "c": ["param"] * 7}]
    assert state_differences(got, ref) == ["rank 0: a: device type 'cuda' != 'cpu'",
                                           "rank 0: b missing from the engine under test",
                                           "rank 0: c only in the engine under test"]
    assert state_differences(ref, ref) == []


class ScaledAttn(Attn):
    """vLLM's KV-cache quant method: KVCacheScaleParameter() wraps torch.tensor(-1.0), so the skeleton's parameter
    is real too; post-processing deletes it (here ``k_scale``) or the checkpoint fills it (``v_scale``)."""

    def __init__(self):
        super().__init__()
        self.k_scale = nn.Parameter(torch.tensor(-1.0), requires_grad=False)
        self.v_scale = nn.Parameter(torch.tensor(-1.0), requires_grad=False)


def test_a_parameter_over_a_small_tensor_is_removed_or_installed_in_place_as_the_daemons():
    def post(m):
        del m.k_scale

    m, exp, as_built = daemon(post, ScaledAttn)
    assert "k_scale" in exp.dropped and "v_scale" in exp.tensors and "k_scale" not in exp.tensors
    eng, done = engine(exp, as_built, ScaledAttn)
    audit(eng, exp.objects, done)
    assert not hasattr(eng, "k_scale") and "k_scale" not in dict(eng.named_parameters())
    assert torch.equal(eng.v_scale, m.v_scale) and float(m.v_scale) != -1.0  # the loaded value, not the sentinel


def test_a_manifest_cannot_remove_a_weight():
    """``dropped`` may name only small tensors the engine's constructor made: a manifest naming a weight (or the
    large tensor on meta) is refused, not obeyed."""
    from vllm_fastload.ipc.memory.state import InstallError

    m, exp, as_built = daemon(lambda m: None)
    for name in ("w", "big"):
        exp.dropped = [name]
        with pytest.raises(InstallError, match=rf"lists '{name}' as removed by post-processing, but in this model it "
                                               r"is not a small tensor the constructor made"):
            engine(exp, as_built)


class LongRope(nn.Module):
    """Phi-3's long-RoPE: a small torch.tensor of rescale factors combined with an arange at construction."""

    def __init__(self):
        super().__init__()
        factors = torch.tensor([1.0 + i / 10 for i in range(8)], dtype=torch.float32)
        inv_freq = 1.0 / (factors * (10000 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16)))
        self.register_buffer("cache", torch.cat([inv_freq.cos(), inv_freq.sin()]), persistent=False)
        self.register_buffer("_k_scale", torch.tensor(1.0))


def test_a_constructor_that_computes_with_a_small_tensor_and_meta_ones_builds_and_maps():
    m, exp, as_built = daemon(lambda m: None, LongRope)
    assert "cache" in exp.tensors and "_k_scale" not in exp.tensors
    eng, done = engine(exp, as_built, LongRope)  # the skeleton's arange is meta, the factors real: computed on meta
    audit(eng, exp.objects, done)
    assert torch.equal(eng.cache, m.cache) and eng._k_scale.device.type == "cpu"


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.tensor(1.0)
        self.b = self.a


def test_the_helpers_attack_cases_build_export_and_install():
    """From a helper's attack on ddeebb6: torch.tensor of a meta tensor in the skeleton; a small tensor whose
    size changes through ``.data`` (the daemon's comparison crashed); one of two names of a small tensor changed
    and the other removed (install refused the valid manifest)."""
    with torch.device("meta"), SmallOnDevice("cpu"):
        assert torch.tensor(torch.empty(3)).is_meta  # as without the mode (torch cannot copy out of meta)

    def grow(m):
        m._k_scale.data = torch.tensor([1.0, 2.0])

    m, exp, as_built = daemon(grow)
    assert "_k_scale" in exp.tensors
    eng, done = engine(exp, as_built)
    audit(eng, exp.objects, done)
    assert torch.equal(eng._k_scale, torch.tensor([1.0, 2.0]))

    def change_one_drop_other(m):
        m.b.fill_(2.0)
        del m.a

    m, exp, as_built = daemon(change_one_drop_other, Shared)
    assert exp.dropped == ["a"] and "b" in exp.tensors
    eng, done = engine(exp, as_built, Shared)
    audit(eng, exp.objects, done)
    assert not hasattr(eng, "a") and float(eng.b) == 2.0


def test_a_constructor_that_fails_on_meta_is_a_fallback_not_a_crash(monkeypatch):
    from vllm_fastload.errors import CacheUnavailable
    from vllm_fastload.ipc.engine import mapping

    def build(*a):
        raise RuntimeError("Tensor on device meta is not on the expected device cpu!")

    monkeypatch.setattr(mapping, "_build_model", build)
    with pytest.raises(CacheUnavailable, match=r"could not build the model on the meta device .*RuntimeError: Tensor "
                                                r"on device meta"):
        mapping._skeleton(None, None, "", None)
