"""ipc_cache on MoE/MLA-shaped layers (issue 26), one toy per mechanism, each failing without its rule:

* a quant method that is itself a module (vLLM's fused-MoE methods are CustomOps) builds its kernel on itself:
  the *layer* that owns it is re-processed, not the method;
* a module holding another module's parameter by reference (DeepSeek-V3's router and the gate's score bias): the
  reference follows the installed tensor instead of keeping the skeleton's meta original;
* a re-processed layer gets the parameter classes its skeleton built (vLLM's BasevLLMParameter subclasses, which
  Machete's GPTQ post-processing asserts on);
* the engine audits what it built: a meta tensor left anywhere, or an object the daemon's post-processing bound
  that re-processing did not bind again, is an InstallError (a fallback), not a crash at the first forward;
* state bound where no processing unit owns it cannot be rebuilt: the daemon refuses it (NotExportable);
* a layer vLLM processes while its weights load (online quantization) is captured as loaded and re-processed.
"""

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402

from vllm_fastload.ipc.memory.state import (  # noqa: E402
    InstallError,
    NotExportable,
    audit,
    capture_processing,
    collect,
    install,
    object_states,
    processing_units,
    reprocess_modules,
    snapshot,
)


class Kernel:
    """Stands for vLLM's FusedMoEKernel: built by post-processing from the layer's weights."""

    def __init__(self, w):
        self.w = w


class ModuleMethod(QuantizeMethodBase, nn.Module):
    """Like UnquantizedFusedMoEMethod (a CustomOp): a quant method that is a module, keeping its kernel on itself."""

    def __init__(self):
        nn.Module.__init__(self)
        self.kernel = None

    def create_weights(self, *a, **k):
        pass

    def apply(self, layer, x):
        assert self.kernel is not None, "kernel not built"  # vLLM: assert self.moe_kernel is not None
        return x @ self.kernel.w.t()

    def process_weights_after_loading(self, layer):
        self.kernel = Kernel(layer.w13.data * 2)


class Router:
    """A plain (non-module) vLLM-like object holding the gate's bias by reference, as fused-MoE routers do."""

    __module__ = "vllm.model_executor.layers.fused_moe.router.toy"

    def __init__(self, bias):
        self.e_score_correction_bias = bias


class Experts(nn.Module):
    def __init__(self, gate):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(4, 3), requires_grad=False)
        self.quant_method = ModuleMethod()
        self.router = Router(gate.e_score_correction_bias)


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2, 3), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(2), requires_grad=False)


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.experts = Experts(self.gate)


def built(cls=Moe, device=None):
    with torch.device(device or "cpu"):
        return cls()


def daemon(cls=Moe):
    torch.manual_seed(0)
    m = built(cls)
    constructed = object_states(m)
    for p in m.parameters():
        p.data.normal_()
    snap = snapshot(m)
    for mod in m.modules():
        qm = getattr(mod, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase) and not isinstance(mod, QuantizeMethodBase):
            qm.process_weights_after_loading(mod)
    return m, collect(m, snap, constructed)


def engine(exp, cls=Moe):
    eng = built(cls, "meta")
    install(eng, dict(exp.tensors), exp.aliases, exp.reprocess, exp.attrs, exp.object_attrs)
    return eng


def test_the_layer_that_owns_a_module_quant_method_is_reprocessed_and_its_kernel_rebuilt():
    m, exp = daemon()
    assert processing_units(m) == {"experts"}  # not "experts.quant_method": that is the method itself
    assert exp.reprocess == ["experts"]
    assert exp.objects == {"experts.quant_method": ["kernel"]}
    eng = engine(exp)
    reprocess_modules(eng, exp.reprocess, model_config=None)
    audit(eng, exp.objects)
    x = torch.randn(5, 3)
    assert torch.equal(eng.experts.quant_method.apply(eng.experts, x), m.experts.quant_method.apply(m.experts, x))


def test_a_reference_to_another_modules_parameter_follows_the_installed_tensor():
    m, exp = daemon()
    eng = engine(exp)
    bias = eng.experts.router.e_score_correction_bias
    assert bias is eng.gate.e_score_correction_bias and bias.device.type == "cpu"
    assert torch.equal(bias, m.gate.e_score_correction_bias)


class Shared(Moe):
    """A module that is no processing unit holding the gate's bias through a vLLM-like object (as a shared
    expert's router might): nothing re-processes it."""

    def __init__(self):
        super().__init__()
        self.side = nn.Module()
        self.side.router = Router(self.gate.e_score_correction_bias)


def test_a_reference_outside_re_processed_units_is_pointed_by_the_audits_walk(monkeypatch):
    """Where install gives the skeleton's tensor objects new contents (the default) a reference any object took at
    construction is already the installed tensor. Where it cannot (replaced by new objects, as here), install
    points references only inside re-processed units (whose re-processing may read them) and leaves the rest to
    the audit, which walks the whole model anyway: one walk instead of two. Without the replaced tensors the audit
    names the reference it cannot restore."""
    from vllm_fastload.ipc.memory import state

    m, exp = daemon(Shared)
    eng = built(Shared, "meta")
    install(eng, dict(exp.tensors), exp.aliases, exp.reprocess, exp.attrs, exp.object_attrs)
    assert eng.side.router.e_score_correction_bias is eng.gate.e_score_correction_bias
    assert torch.equal(eng.side.router.e_score_correction_bias, m.gate.e_score_correction_bias)

    monkeypatch.setattr(state, "_SWAP_IMPL", None)
    eng = built(Shared, "meta")
    done = install(eng, dict(exp.tensors), exp.aliases, exp.reprocess, exp.attrs, exp.object_attrs)
    assert eng.experts.router.e_score_correction_bias is eng.gate.e_score_correction_bias  # re-processed unit
    assert eng.side.router.e_score_correction_bias.device.type == "meta"  # left for the audit
    reprocess_modules(eng, exp.reprocess, model_config=None)
    with pytest.raises(InstallError, match=r"side\.router\.e_score_correction_bias still refers to a meta-device"):
        audit(eng, exp.objects)
    audit(eng, exp.objects, done)
    assert eng.side.router.e_score_correction_bias is eng.gate.e_score_correction_bias
    assert torch.equal(eng.side.router.e_score_correction_bias, m.gate.e_score_correction_bias)


def test_audit_refuses_a_meta_reference_nothing_can_restore():
    _, exp = daemon()
    eng = engine(exp)
    eng.experts.router.stale = torch.empty(3, device="meta")  # held by the object, in no cache entry
    reprocess_modules(eng, exp.reprocess, model_config=None)
    with pytest.raises(InstallError, match=r"experts\.router\.stale still refers to a meta-device tensor"):
        audit(eng, exp.objects)


def test_audit_refuses_an_object_that_re_processing_did_not_bind_again():
    _, exp = daemon()
    eng = engine(exp)
    # no re-processing: the kernel the daemon's post-processing built is missing (the engine would die at its
    # first forward, as vLLM's fused MoE did: "assert self.moe_kernel is not None")
    with pytest.raises(InstallError, match=r"experts\.quant_method\.kernel was bound by post-processing in the "
                                           r"daemon but is missing"):
        audit(eng, exp.objects)


class Packed(nn.Parameter):
    """Stands for vLLM's PackedvLLMParameter: a Parameter subclass with loader metadata in its __dict__."""

    @property
    def packed_dim(self):
        return self._packed_dim


class PackingMethod(QuantizeMethodBase):
    """Like Machete's GPTQ post-processing: asserts on the parameter class, then binds a kernel closure."""

    def create_weights(self, *a, **k):
        pass

    def apply(self, layer, x):
        return layer.kernel(x)

    def process_weights_after_loading(self, layer):
        assert isinstance(layer.qweight, Packed), type(layer.qweight)  # vLLM: isinstance(x, BasevLLMParameter)
        w = layer.qweight.data.clone()
        layer.kernel = lambda x: x @ w.t()


class GptqLinear(nn.Module):
    def __init__(self):
        super().__init__()
        p = Packed(torch.empty(4, 3), requires_grad=False)
        p._packed_dim = 1
        self.qweight = p
        self.quant_method = PackingMethod()


def test_a_reprocessed_layer_keeps_the_parameter_classes_its_skeleton_built():
    m, exp = daemon(GptqLinear)
    assert exp.reprocess == [""]  # the root module is the layer here
    eng = engine(exp, GptqLinear)
    assert type(eng.qweight) is Packed and eng.qweight.packed_dim == 1 and eng.qweight.device.type == "cpu"
    reprocess_modules(eng, exp.reprocess, model_config=None)  # asserts on the class, as Machete does
    audit(eng, exp.objects)
    x = torch.randn(2, 3)
    assert torch.equal(eng.quant_method.apply(eng, x), m.quant_method.apply(m, x))


def test_state_that_no_processing_unit_owns_is_refused_by_the_daemon():
    class Loose(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(2), requires_grad=False)

    m = built(Loose)
    snap = snapshot(m)
    m.cache = Kernel(m.w)  # bound after loading by nothing vLLM would run again
    with pytest.raises(NotExportable, match=r"bound 'cache' on module '' \(Loose\), which no re-processable layer "
                                            r"owns.*--load-format runai_streamer"):
        collect(m, snap, object_states(built(Loose)))


def test_private_tensor_attributes_cross_to_the_engine():
    """vLLM's attention keeps _k_scale_cpu as a plain tensor made at construction (meta in a skeleton) and
    filled by post-processing: it must arrive, not stay meta."""

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self._k_scale_cpu = torch.tensor(1.0)

    m = built(Attn)
    snap = snapshot(m)
    m._k_scale_cpu.fill_(0.5)
    exp = collect(m, snap, object_states(built(Attn)))
    assert "_k_scale_cpu" in exp.tensors
    eng = engine(exp, Attn)
    audit(eng)
    assert float(eng._k_scale_cpu) == 0.5


class OnlineMethod(ModuleMethod):
    """Like vLLM 0.26's Fp8PerTensorOnlineMoEMethod: quantizes the loaded weights (here: to bfloat16) into a new
    parameter and builds its kernel, once (the flag), called by vLLM's layer-wise loader inside load_weights."""

    def process_weights_after_loading(self, layer):
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        layer.w13 = nn.Parameter(layer.w13.data.to(torch.bfloat16), requires_grad=False)
        self.kernel = Kernel(layer.w13.data.float())
        layer._already_called_process_weights_after_loading = True


class OnlineMoe(Moe):
    def __init__(self):
        super().__init__()
        self.experts.quant_method = OnlineMethod()


def online_daemon():
    """The daemon's load of OnlineMoe: weights arrive, vLLM processes the experts layer as its last weight lands
    (inside the capture), then the post-loading pass (which the flag makes a no-op)."""
    torch.manual_seed(0)
    m = built(OnlineMoe)
    constructed = object_states(m)
    with capture_processing(m, constructed) as captured:
        for p in m.parameters():
            p.data.normal_()
        m.experts.quant_method.process_weights_after_loading(m.experts)  # _layerwise_process's call
    snap = snapshot(m, captured)
    m.experts.quant_method.process_weights_after_loading(m.experts)
    return m, snap, constructed


def test_a_unit_vllm_processes_while_loading_is_exported_as_loaded_and_reprocessed_by_the_engine():
    """Online FP8 of a fused-MoE layer (vLLM 0.26 ``Fp8PerTensorOnlineMoEMethod``): vLLM quantizes the layer while
    its weights load. The daemon captures the layer when that processing starts, exports the loaded weights and
    marks the layer for re-processing; the engine quantizes them itself and gets the daemon's kernel. Without the
    capture the daemon had only the quantized weights (seen on the H200 as a dtype refusal at install, then a
    refusal at daemon start)."""
    m, snap, constructed = online_daemon()
    assert "process_weights_after_loading" not in vars(m.experts.quant_method)  # the wrapper is gone
    exp = collect(m, snap, constructed)
    assert exp.reprocess == ["experts"] and exp.objects == {"experts.quant_method": ["kernel"]}
    kind, w13 = exp.tensors["experts.w13"]
    assert w13.dtype == torch.float32 and torch.equal(w13.to(torch.bfloat16), m.experts.w13)  # as loaded
    assert "_already_called_process_weights_after_loading" not in exp.attrs.get("experts", {})
    eng = engine(exp, OnlineMoe)
    reprocess_modules(eng, exp.reprocess, model_config=None)
    audit(eng, exp.objects)
    assert eng.experts.w13.dtype == torch.bfloat16 and torch.equal(eng.experts.w13, m.experts.w13)
    x = torch.randn(5, 3)
    assert torch.equal(eng.experts.quant_method.apply(eng.experts, x), m.experts.quant_method.apply(m.experts, x))


class OnlineLinearMethod(QuantizeMethodBase):
    """Like vLLM 0.26's Fp8PerTensorOnlineLinearMethod: quantizes the loaded weight into a new parameter and sets
    plain values, once; binds no object."""

    def create_weights(self, *a, **k):
        pass

    def apply(self, layer, x):
        return x @ layer.weight.float().t()

    def process_weights_after_loading(self, layer):
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        layer.weight = nn.Parameter(layer.weight.data.to(torch.bfloat16), requires_grad=False)
        layer.input_scale = None
        layer._already_called_process_weights_after_loading = True


class OnlineLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 3), requires_grad=False)
        self.quant_method = OnlineLinearMethod()


def test_a_unit_processed_while_loading_that_binds_no_object_is_not_kept_and_exported_as_processed():
    """Online FP8 of a dense linear leaves only tensors and plain values: the capture does not keep its loaded
    weights (the daemon would otherwise hold every bf16 weight beside its FP8 one until export: 1.5x the model),
    and the layer is exported as processed, as before the capture existed."""
    torch.manual_seed(0)
    m = built(OnlineLinear)
    constructed = object_states(m)
    with capture_processing(m, constructed) as captured:
        m.weight.data.normal_()
        loaded = m.weight.data
        m.quant_method.process_weights_after_loading(m)
    assert captured == {}
    snap = snapshot(m, captured)
    exp = collect(m, snap, constructed)
    assert exp.reprocess == [] and exp.tensors["weight"][1].dtype == torch.bfloat16
    assert torch.equal(exp.tensors["weight"][1], loaded.to(torch.bfloat16))
    assert exp.attrs[""]["_already_called_process_weights_after_loading"] is True


def test_a_unit_processed_while_loading_unseen_by_the_capture_is_refused_by_the_daemon():
    """Processed during loading where the capture did not see it: the loaded weights are gone, so a layer that
    needs re-processing cannot be exported faithfully; the daemon refuses at start, naming layer and method."""
    torch.manual_seed(0)
    m = built(Moe)
    constructed = object_states(m)
    for p in m.parameters():
        p.data.normal_()
    m.experts._already_called_process_weights_after_loading = True  # processed (and flagged) outside the capture
    snap = snapshot(m)
    m.experts.quant_method.process_weights_after_loading(m.experts)
    with pytest.raises(NotExportable, match=r"post-processed module 'experts' \(Experts, quant method ModuleMethod\) "
                                            r"while loading.*online quantization.*--load-format runai_streamer"):
        collect(m, snap, constructed)
    # the same layer processed after the snapshot (offline checkpoints) is exported for re-processing
    m2 = built(Moe)
    snap2 = snapshot(m2)
    m2.experts.quant_method.process_weights_after_loading(m2.experts)
    assert collect(m2, snap2, object_states(built(Moe))).reprocess == ["experts"]



class Weight(nn.Parameter):
    """Stands for vLLM's ModelWeightParameter (every linear weight of a GPU engine): a Parameter subclass whose
    loader metadata is in its ``__dict__`` and whose weight loading is its own methods."""

    def load_column_parallel_weight(self, loaded):
        self.data.copy_(loaded)


class KeepMethod(QuantizeMethodBase):
    """Like vLLM's unquantized linear method on a GPU: post-processing leaves the parameter as it was built."""

    def create_weights(self, *a, **k):
        pass

    def apply(self, layer, x):
        return x @ layer.weight.t()

    def process_weights_after_loading(self, layer):
        pass


class ReplaceMethod(KeepMethod):
    """Like vLLM's FP8 linear methods: post-processing replaces the parameter by a plain ``nn.Parameter``."""

    def process_weights_after_loading(self, layer):
        layer.weight = nn.Parameter(layer.weight.data * 2, requires_grad=False)


class Linears(nn.Module):
    def __init__(self):
        super().__init__()
        self.kept, self.replaced = nn.Module(), nn.Module()
        for mod, method in ((self.kept, KeepMethod()), (self.replaced, ReplaceMethod())):
            w = Weight(torch.empty(4, 3), requires_grad=False)
            vars(w).update(output_dim=0, input_dim=1, weight_loader=Weight.load_column_parallel_weight)
            mod.weight = w
            mod.quant_method = method


def test_a_parameter_post_processing_kept_keeps_its_class_in_the_engine_and_a_replaced_one_does_not():
    """The daemon exports a processed module's parameter that is still of the class the model built it with as
    ``kept_param`` and the engine keeps its skeleton's object for it (class, attributes, the weight-loading
    methods a later ``load_weights`` calls), as a disk load does; a parameter post-processing replaced by a
    plain ``nn.Parameter`` is exported as ``param`` and installed as one. Without ``parameter_classes`` (an older
    daemon's call) every parameter is ``param``."""
    from vllm_fastload.ipc.memory.state import parameter_classes

    torch.manual_seed(0)
    m = built(Linears)
    constructed, classes = object_states(m), parameter_classes(m)
    assert classes == {"kept.weight": Weight, "replaced.weight": Weight}
    for p in m.parameters():
        p.data.normal_()
    snap = snapshot(m)
    for mod in (m.kept, m.replaced):
        mod.quant_method.process_weights_after_loading(mod)
    exp = collect(m, snap, constructed, classes)
    assert exp.reprocess == []
    assert {k: kind for k, (kind, _) in exp.tensors.items()} == {"kept.weight": "kept_param",
                                                                   "replaced.weight": "param"}
    assert {kind for kind, _ in collect(m, snap, constructed).tensors.values()} == {"param"}

    eng = built(Linears, "meta")
    skeleton = eng.kept.weight
    tensors = {k: (kind, t.clone()) for k, (kind, t) in exp.tensors.items()}
    install(eng, tensors, exp.aliases, exp.reprocess, exp.attrs, exp.object_attrs)
    audit(eng, exp.objects)
    assert eng.kept.weight is skeleton and type(skeleton) is Weight and not skeleton.is_meta
    assert vars(skeleton)["output_dim"] == 0 and vars(skeleton)["input_dim"] == 1
    assert torch.equal(eng.kept.weight, m.kept.weight)
    assert type(eng.replaced.weight) is nn.Parameter and torch.equal(eng.replaced.weight, m.replaced.weight)
    x = torch.randn(2, 3)
    assert torch.equal(eng.kept.quant_method.apply(eng.kept, x), m.kept.quant_method.apply(m.kept, x))
    # a later load_weights (an RL trainer's weight sync) goes through the class's own loader, as with `auto`
    new = torch.randn(4, 3)
    vars(eng.kept.weight)["weight_loader"](eng.kept.weight, new)
    assert torch.equal(eng.kept.weight, new)
