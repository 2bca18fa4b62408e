"""The per-module export rule with toy layers, through the real shared-memory transport (no vLLM server)."""

import gc
import re

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402

from vllm_fastload.ipc.daemon.export import pack  # noqa: E402
from vllm_fastload.ipc.memory.layout import sample_checksums, view_at, views  # noqa: E402
from vllm_fastload.ipc.memory.memfd import MemfdTransport  # noqa: E402
from vllm_fastload.ipc.memory.state import InstallError, collect, install, object_states, reprocess_modules, snapshot  # noqa: E402
from vllm_fastload.ipc.wire.messages import TensorRow, TensorTable  # noqa: E402


class Packing(QuantizeMethodBase):
    """Like oneDNN/sgl packing: a closure over a packed copy, and layer.weight replaced by an empty tensor."""

    def create_weights(self, *a, **k):
        pass

    def apply(self, layer, x, bias=None):
        return layer.cpu_linear(x)

    def process_weights_after_loading(self, layer):
        packed = layer.weight.t().contiguous() * 1  # a new object the engine cannot receive
        layer.cpu_linear = lambda x: x @ packed
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


class Scaling(QuantizeMethodBase):
    """Post-processing that only leaves tensors behind: a rescaled weight and a tensor attribute."""

    def create_weights(self, *a, **k):
        pass

    def apply(self, layer, x, bias=None):
        return (x @ layer.weight.t()) * layer.scale

    def process_weights_after_loading(self, layer):
        scale = layer.weight.abs().max()
        layer.weight = nn.Parameter(layer.weight / scale, requires_grad=False)
        layer.scale = scale


class Toy(nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.lin = nn.Module()
        self.lin.weight = nn.Parameter(torch.empty(4, 3, device=device), requires_grad=False)
        self.lin.quant_method = Packing()
        self.sc = nn.Module()
        self.sc.weight = nn.Parameter(torch.empty(2, 3, device=device), requires_grad=False)
        self.sc.quant_method = Scaling()
        self.tied = self.sc  # an alias module path


def daemon_side():
    torch.manual_seed(0)
    m = Toy()
    m.lin.weight.data.normal_()
    m.sc.weight.data.normal_()
    x = torch.randn(5, 3)
    snap = snapshot(m)
    for mod in (m.lin, m.sc):
        mod.quant_method.process_weights_after_loading(mod)
    expect = (m.lin.quant_method.apply(m.lin, x), m.sc.quant_method.apply(m.sc, x))
    return m, snap, x, expect


def transported(exp):
    seg, entries = pack({k: t for k, (_, t) in exp.tensors.items()})
    import os

    cpu = torch.device("cpu")
    mapped = MemfdTransport().open(os.dup(seg.fd), MemfdTransport().describe(seg, cpu), cpu)
    assert sample_checksums(mapped.buf, entries).tolist() == entries.checksum
    out = {}
    for k, e in entries.rows():
        out[k] = (exp.tensors[k][0], view_at(mapped.buf, e, k))
    return seg, mapped, out


def test_both_paths_round_trip():
    m, snap, x, (want_lin, want_sc) = daemon_side()
    exp = collect(m, snap)
    assert exp.reprocess == ["lin"]  # packing bound a closure: re-run on the engine
    assert set(exp.tensors) == {"lin.weight", "sc.weight", "sc.scale"}
    assert exp.tensors["lin.weight"][1].shape == (4, 3)  # the loaded weight, not the empty one
    assert exp.tensors["sc.scale"][0] == "attr"
    seg, mm, tensors = transported(exp)
    with torch.device("meta"):
        eng = Toy()
    install(eng, tensors, exp.aliases, exp.reprocess)
    reprocess_modules(eng, exp.reprocess, model_config=None)
    assert torch.equal(eng.lin.quant_method.apply(eng.lin, x), want_lin)
    assert torch.equal(eng.sc.quant_method.apply(eng.sc, x), want_sc)
    assert eng.tied is eng.sc
    seg.close()


def test_corrupted_memory_fails_the_checksum():
    m, snap, _, _ = daemon_side()
    seg, entries = pack({k: t for k, (_, t) in collect(m, snap).tensors.items()})
    e = entries["sc.weight"]
    assert sample_checksums(seg.buf, entries).tolist() == entries.checksum
    seg.buf[e.offset + e.nbytes // 2] ^= 0xFF  # the middle window
    crcs = sample_checksums(seg.buf, entries).tolist()
    i = entries.index["sc.weight"]
    assert crcs[i] != e.checksum
    assert [c for j, c in enumerate(crcs) if j != i] == [c for j, c in enumerate(entries.checksum) if j != i]
    seg.close()


def test_shape_mismatch_of_a_reprocessed_module_names_the_tensor():
    m, snap, _, _ = daemon_side()
    exp = collect(m, snap)
    bad = dict(exp.tensors)
    bad["lin.weight"] = ("param", torch.zeros(5, 3))
    with torch.device("meta"):
        eng = Toy()
    with pytest.raises(InstallError, match=r"'lin.weight' is torch.float32 \(5, 3\).*expects torch.float32 \(4, 3\)"):
        install(eng, bad, exp.aliases, exp.reprocess)


class Dropping(Scaling):
    """Post-processing that rescales and deletes a parameter the engine's skeleton still builds."""

    def process_weights_after_loading(self, layer):
        super().process_weights_after_loading(layer)
        del layer.zero_point


def test_a_tensor_post_processing_removed_is_removed_by_the_audit_and_a_reprocessed_ones_missing_is_refused():
    """A skeleton parameter the daemon's post-processing deleted (not in the cache) of a module that re-processing
    does not reach is left by install and removed by the audit's walk (one walk of the model, not two); one of a
    re-processed module is refused by install, naming it (re-processing would run on a meta tensor)."""
    from vllm_fastload.ipc.memory.state import audit

    def build(device=None):
        m = Toy(device)
        m.sc.quant_method = Dropping()
        m.sc.zero_point = nn.Parameter(torch.zeros(2, device=device), requires_grad=False)
        return m

    torch.manual_seed(0)
    m = build()
    m.lin.weight.data.normal_()
    m.sc.weight.data.normal_()
    snap = snapshot(m)
    for mod in (m.lin, m.sc):
        mod.quant_method.process_weights_after_loading(mod)
    exp = collect(m, snap)
    assert exp.reprocess == ["lin"] and "sc.zero_point" not in exp.tensors
    seg, mm, tensors = transported(exp)
    with torch.device("meta"):
        eng = build()
    done = install(eng, tensors, exp.aliases, exp.reprocess)
    assert eng.sc._parameters["zero_point"].is_meta and done.swept == {"lin"}
    reprocess_modules(eng, exp.reprocess, model_config=None)
    audit(eng, exp.objects, done)
    assert "zero_point" not in eng.sc._parameters
    assert not any(t.is_meta for t in eng.parameters()) and not any(t.is_meta for t in eng.buffers())
    assert torch.equal(eng.sc.weight, m.sc.weight)
    with torch.device("meta"):
        eng = build()
    missing = {k: v for k, v in tensors.items() if k != "lin.weight"}
    with pytest.raises(InstallError, match=r"lin\.weight was not in the cache \(its module is re-processed here\)"):
        install(eng, missing, exp.aliases, exp.reprocess)
    del mm
    seg.close()


def test_the_audit_removes_only_what_the_daemon_did_not_export_and_install_did_not_sweep():
    """The audit's removal is for skeleton tensors post-processing removed: a meta tensor under a name the cache
    filled (something put it on the meta device after install), or one in a module install swept (re-processing
    made it), is refused naming it, never dropped; without install's record the audit refuses every meta
    tensor, as before."""
    from vllm_fastload.ipc.memory.state import audit

    def build(device=None):
        m = Toy(device)
        m.sc.quant_method = Dropping()
        m.sc.zero_point = nn.Parameter(torch.zeros(2, device=device), requires_grad=False)
        return m

    m = build()
    snap = snapshot(m)
    for mod in (m.lin, m.sc):
        mod.quant_method.process_weights_after_loading(mod)
    exp = collect(m, snap)
    seg, mm, tensors = transported(exp)
    try:
        cases = {
            "sc.weight": lambda eng: setattr(eng.sc, "weight", nn.Parameter(torch.empty(2, 3, device="meta"))),
            "lin.made": lambda eng: eng.lin.register_parameter("made", nn.Parameter(torch.empty(1, device="meta"))),
        }
        for name, spoil in cases.items():
            with torch.device("meta"):
                eng = build()
            done = install(eng, {k: (kind, t) for k, (kind, t) in tensors.items()}, exp.aliases, exp.reprocess)
            spoil(eng)
            with pytest.raises(InstallError, match=rf"{re.escape(name)} is still on the meta device"):
                audit(eng, exp.objects, done)
        with torch.device("meta"):
            eng = build()
        install(eng, dict(tensors), exp.aliases, exp.reprocess)
        with pytest.raises(InstallError, match=r"sc\.zero_point is still on the meta device"):
            audit(eng, exp.objects)
    finally:
        del mm
        seg.close()


def test_a_module_shared_into_a_re_processed_unit_is_swept_there_and_owned_by_its_first_name():
    """Re-processing reaches a module through every name it has, so install sweeps it under each (not left for
    the audit); whose tensors must come from the cache is the daemon's rule, by the module's first name: first
    outside the re-processed unit, a skeleton tensor it lacks is removed; first inside, it is refused."""
    from vllm_fastload.ipc.memory.state import survey

    def build(outside_first):
        shared = nn.Module()
        shared.w = nn.Parameter(torch.empty(1, device="meta"))
        a, b = nn.Module(), nn.Module()
        a.s = b.s = shared
        b.quant_method = Scaling()
        model = nn.Module()
        for name in ("a", "b") if outside_first else ("b", "a"):  # pre-order: the first child's s comes first
            model.add_module(name, a if name == "a" else b)
        return model, shared

    model, shared = build(outside_first=True)
    _, _, units, owned, reached = survey(model, {"b"})
    assert units == {"b"} and owned == {"b", "b.s"}  # by name, as the daemon names the tensors it exports
    assert [(n, first) for n, _, first in reached] == [("b", True), ("b.s", False)]
    done = install(model, {}, {}, ["b"])
    assert "w" not in shared._parameters and done.swept == {"b", "b.s"}
    model, shared = build(outside_first=False)
    with pytest.raises(InstallError, match=r"b\.s\.w was not in the cache"):
        install(model, {}, {}, ["b"])
    assert "w" in shared._parameters


def _exported(m):
    """The daemon's side for ``m``: weights drawn uniform in [0.5, 2), a snapshot, every unit's quant method
    post-processing in module order (as vLLM runs it), then the export (:func:`collect`)."""
    torch.manual_seed(0)
    for p in m.parameters():
        p.data.uniform_(0.5, 2.0)
    snap = snapshot(m)
    for mod in m.modules():
        qm = getattr(mod, "quant_method", None)
        if isinstance(qm, QuantizeMethodBase) and not isinstance(mod, QuantizeMethodBase):
            qm.process_weights_after_loading(mod)
    return collect(m, snap)


def _mapped(build, exp, after_install, run, want):
    """The engine's side of ``exp`` (install into ``build()`` on the meta device, ``after_install(eng)``,
    re-processing, audit) over a memfd segment, then ``run(eng)`` must equal ``want`` exactly. Returns the model."""
    from vllm_fastload.ipc.memory.state import audit

    seg, mm, tensors = transported(exp)
    try:
        with torch.device("meta"):
            eng = build()
        done = install(eng, tensors, exp.aliases, exp.reprocess, exp.attrs, exp.object_attrs)
        if after_install is not None:
            after_install(eng)
        reprocess_modules(eng, exp.reprocess, model_config=None)
        audit(eng, exp.objects, done)
        assert torch.equal(run(eng), want)
    finally:
        del mm
        seg.close()
    return eng


class _DropsInputScale(Scaling):
    """A processed unit whose post-processing deletes a parameter (as Marlin FP8 deletes ``input_scale``)."""

    def process_weights_after_loading(self, layer):
        super().process_weights_after_loading(layer)
        del layer.input_scale


class _ReadsSharedKv(Scaling):
    """A unit that binds a closure over a module it shares with another unit (as an MLA layer holds its
    ``kv_b_proj``): re-processed by the engine."""

    def apply(self, layer, x, bias=None):
        return layer.fn(x)

    def process_weights_after_loading(self, layer):
        w, own = layer.kv.weight * layer.kv.scale, layer.weight
        layer.fn = lambda x: x @ (w.t() @ own)


class _MlaLike(nn.Module):
    def __init__(self):
        super().__init__()
        kv = nn.Module()
        kv.weight = nn.Parameter(torch.empty(4, 3), requires_grad=False)
        kv.input_scale = nn.Parameter(torch.empty(1), requires_grad=False)
        kv.quant_method = _DropsInputScale()
        self.kv = kv
        self.mla = nn.Module()
        self.mla.weight = nn.Parameter(torch.empty(4, 4), requires_grad=False)
        self.mla.quant_method = _ReadsSharedKv()
        self.mla.kv = kv  # the same module under a second name, inside the re-processed unit


def test_a_processed_unit_shared_into_a_re_processed_one_maps_as_the_daemon_computed_it():
    """From a helper's attack on a11c0f5: ``kv`` (processed: rescaled, ``input_scale`` deleted) is also
    ``mla.kv`` inside the re-processed ``mla``. The daemon exports it under its first name as processed; install
    must not refuse its missing ``input_scale`` under the second name (a disk fallback on every such layer), and
    the engine's re-processed ``mla`` computes what the daemon's did."""
    m = _MlaLike()
    exp = _exported(m)  # kv processed first, then mla (module order)
    assert exp.reprocess == ["mla"] and "kv.input_scale" not in exp.tensors

    def swept(eng):
        assert "input_scale" not in eng.kv._parameters  # before re-processing

    x = torch.randn(2, 3)
    _mapped(_MlaLike, exp, swept, lambda eng: eng.mla.quant_method.apply(eng.mla, x),
            m.mla.quant_method.apply(m.mla, x))


class _ToPlainFloat(Scaling):
    """Post-processing that replaces a parameter by a plain value of the same name (exported in ``attrs``)."""

    def apply(self, layer, x, bias=None):
        return (x @ layer.weight.t()) * layer.scale * layer.act_scale

    def process_weights_after_loading(self, layer):
        super().process_weights_after_loading(layer)
        v = float(layer.act_scale.item())
        del layer.act_scale
        layer.act_scale = v


def test_a_parameter_post_processing_replaced_by_a_plain_value_gets_the_value_where_nothing_is_re_processed():
    """From the same attack: outside the modules re-processing sees, install leaves the skeleton tensors the cache
    did not fill to the audit; the plain value that replaced one in the daemon must still be set (not skipped
    because a meta parameter of that name was still there, then removed by the audit with the value lost)."""

    def build():
        m = nn.Module()
        m.lin = nn.Module()
        m.lin.weight = nn.Parameter(torch.empty(4, 3), requires_grad=False)
        m.lin.act_scale = nn.Parameter(torch.empty(()), requires_grad=False)
        m.lin.quant_method = _ToPlainFloat()
        return m

    m = build()
    exp = _exported(m)
    assert exp.reprocess == [] and isinstance(exp.attrs["lin"]["act_scale"], float)
    x = torch.randn(2, 3)
    eng = _mapped(build, exp, None, lambda eng: eng.lin.quant_method.apply(eng.lin, x),
                  m.lin.quant_method.apply(m.lin, x))
    assert "act_scale" not in eng.lin._parameters and eng.lin.act_scale == m.lin.act_scale


class FoldingScale(Scaling):
    """Folds a scale parameter into the weight and deletes it, then rescales."""

    def process_weights_after_loading(self, layer):
        layer.weight = nn.Parameter(layer.weight * layer.scale_inv, requires_grad=False)
        del layer.scale_inv
        super().process_weights_after_loading(layer)


class Hooked(nn.Module):
    """A model-level hook that picks its path by whether ``proj.scale_inv`` exists (as vLLM's
    ``get_attribute_fallback`` does) and binds a closure, so the daemon marks ``""`` for re-processing."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(2, 3), requires_grad=False)
        self.proj.scale_inv = nn.Parameter(torch.empty(2, 1), requires_grad=False)
        self.proj.quant_method = FoldingScale()

    def process_weights_after_loading(self):
        w = self.proj.weight * self.proj.scale_inv if hasattr(self.proj, "scale_inv") else self.proj.weight
        s = self.proj.scale
        self.fn = lambda x: (x @ w.t()) * s


def test_re_processing_never_sees_a_tensor_post_processing_removed_from_a_processed_unit():
    """From a helper's attack on a375540, which left such tensors on the meta device until the audit: the
    model-level hook (re-processed, after every quant method as in vLLM) then found ``proj.scale_inv`` and failed
    on a meta tensor."""
    torch.manual_seed(0)
    m = Hooked()
    m.proj.weight.data.normal_()
    m.proj.scale_inv.data.uniform_(0.5, 2)
    snap = snapshot(m)
    m.proj.quant_method.process_weights_after_loading(m.proj)
    m.process_weights_after_loading()
    x = torch.randn(4, 3)
    want = m.fn(x)
    exp = collect(m, snap)
    assert exp.reprocess == [""] and "proj.scale_inv" not in exp.tensors
    seg, mm, tensors = transported(exp)
    with torch.device("meta"):
        eng = Hooked()
    from vllm_fastload.ipc.memory.state import audit

    done = install(eng, tensors, exp.aliases, exp.reprocess, exp.attrs, exp.object_attrs)
    reprocess_modules(eng, exp.reprocess, model_config=None)
    audit(eng, exp.objects, done)
    got = eng.fn(x)
    assert got.device.type == "cpu" and torch.allclose(got, want)
    del mm
    seg.close()


class Growing(Scaling):
    """Re-processing that makes a parameter on the device the layer recorded at construction (meta in a skeleton)."""

    def apply(self, layer, x, bias=None):
        return layer.run(x)

    def process_weights_after_loading(self, layer):
        layer.offset = nn.Parameter(torch.ones(layer.weight.shape[0], device=layer.built_on), requires_grad=False)
        w, o = layer.weight, layer.offset
        layer.run = lambda x: x @ w.t() + o


class Grows(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Module()
        self.lin.weight = nn.Parameter(torch.empty(2, 3), requires_grad=False)
        self.lin.built_on = self.lin.weight.device
        self.lin.quant_method = Growing()


def test_the_audit_refuses_a_parameter_re_processing_left_on_the_meta_device():
    """From the same attack: the audit must name such a parameter (the fallback's case), not drop it."""
    from vllm_fastload.ipc.memory.state import audit

    torch.manual_seed(0)
    m = Grows()
    m.lin.weight.data.normal_()
    snap = snapshot(m)
    m.lin.quant_method.process_weights_after_loading(m.lin)
    exp = collect(m, snap)
    assert exp.reprocess == ["lin"]
    seg, mm, tensors = transported(exp)
    with torch.device("meta"):
        eng = Grows()
    done = install(eng, tensors, exp.aliases, exp.reprocess, exp.attrs, exp.object_attrs)
    reprocess_modules(eng, exp.reprocess, model_config=None)
    try:
        with pytest.raises(InstallError, match=r"lin\.offset is still on the meta device"):
            audit(eng, exp.objects, done)
    finally:
        del mm
        seg.close()


def test_strided_and_odd_tensors_keep_layout_and_bytes():
    """FP8 post-processing keeps ``weight.t()``: the export must keep strides, not make it contiguous."""
    base = torch.randn(64, 48)
    ts = {"t": base.t(), "c": torch.randn(3, 5).to(torch.bfloat16), "u8": torch.arange(7, dtype=torch.uint8),
          "empty": torch.empty(0, 4), "overlap": torch.randn(5)[None].expand(3, 5)}
    seg, entries = pack(ts)
    assert entries["t"].stride == [1, 48] and entries["t"].nbytes == 64 * 48 * 4
    assert entries["overlap"].stride == [5, 1]  # an overlapping view is stored contiguous
    assert all(o % 256 == 0 for o in entries.offset)
    all_views = views(seg.buf, entries)
    for k, t in ts.items():
        for got in (view_at(seg.buf, entries[k], k), all_views[k]):
            assert got.stride() == t.stride() or k == "overlap"
            assert got.shape == t.shape and got.dtype == t.dtype and torch.equal(got, t)
            if t.numel():  # a view into the buffer, not a copy
                assert got.data_ptr() == seg.buf.data_ptr() + entries[k].offset
    seg.close()


def test_bad_manifest_entries_are_named():
    seg, entries = pack({"ok": torch.ones(3), "w": torch.ones(4, 4)})
    e = entries["w"]

    def table(**change):  # the table with tensor "w" changed (the good tensor before it must not hide it)
        return TensorTable.of({"ok": entries["ok"], "w": e._replace(**change)})

    with pytest.raises(ValueError, match="'w'.*outside"):
        view_at(seg.buf, e._replace(offset=seg.size), "w")
    with pytest.raises(ValueError, match="'w'.*do not hold"):
        view_at(seg.buf, e._replace(stride=[1, 1]), "w")
    with pytest.raises(ValueError, match="'w'.*unknown dtype 'float99'"):
        view_at(seg.buf, e._replace(dtype="float99"), "w")
    for bad in (view_at, views):  # one row, and the whole table checked at once
        def check(bad=bad, **change):
            return bad(seg.buf, table(**change)) if bad is views else bad(seg.buf, e._replace(**change), "w")

        with pytest.raises(ValueError, match="'w'.*outside"):
            check(offset=seg.size)
        with pytest.raises(ValueError, match="'w'.*offset 258 is not aligned to 4-byte float32"):
            check(offset=258)
        # would pass the size check (span 3 elements x 4 bytes) and crash as_strided instead of falling back
        with pytest.raises(ValueError, match="'w' has a negative stride"):
            check(shape=[2, 2], stride=[3, -1], nbytes=12)
        with pytest.raises(ValueError, match="'w' has a negative dimension"):
            check(shape=[-1, 4], stride=[4, 1])
        with pytest.raises(ValueError, match="'w'.*do not hold"):
            check(shape=[4, 5], stride=[5, 1])
        with pytest.raises(ValueError, match="'w'.*unknown dtype 'float99'"):
            check(dtype="float99")
    with pytest.raises(ValueError, match="'w'.*outside"):  # beyond int64: checked row by row
        views(seg.buf, table(offset=2**70))
    with pytest.raises(ValueError, match="'w'.*outside"):
        sample_checksums(seg.buf, table(offset=seg.size))
    seg.close()


def test_mapping_pauses_the_garbage_collector_and_restores_it():
    from vllm_fastload.heap import gc_paused

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("mapping failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_plain_attributes_set_by_post_processing_reach_the_engine():
    """Online FP8 sets ``layer.input_scale = None`` and a private flag; a skeleton without them would run wrong."""
    import json

    m = Toy()
    snap = snapshot(m)
    m.sc.input_scale = None
    m.sc._already_called_process_weights_after_loading = True
    m.sc.orig_dtype = torch.bfloat16
    m.sc.widths = (3, 4)
    m.sc.where = torch.device("cpu")  # devices do not cross processes
    exp = collect(m, snap)
    attrs = json.loads(json.dumps(exp.attrs))  # what crosses the socket
    assert "where" not in attrs["sc"]
    with torch.device("meta"):
        eng = Toy()
    seg, _mapped, tensors = transported(exp)
    install(eng, tensors, exp.aliases, exp.reprocess, attrs)
    assert eng.sc.input_scale is None and eng.sc._already_called_process_weights_after_loading is True
    assert eng.sc.orig_dtype is torch.bfloat16 and eng.sc.widths == (3, 4)
    seg.close()


class FakeKernel:
    """Like vLLM 0.26's CutlassFP8ScaledMMLinearKernel: post-processing sets ``logical_output_size`` on it."""

    __module__ = "vllm.fake_kernels"  # a vLLM class, as far as the export is concerned

    def __init__(self):
        self.logical_output_size = None
        self.weight_shape = (2, 3)


def _with_kernel(m):
    m.sc.quant_method.kernel = FakeKernel()
    return m


def test_plain_values_inside_vllm_objects_reach_the_engine():
    """Online FP8 on CUDA failed with `assert output_size is not None` before this: the kernel object's value set
    by post-processing was not exported (only module attributes were)."""
    import json

    m = _with_kernel(Toy())
    constructed = object_states(m)
    snap = snapshot(m)
    m.sc.quant_method.kernel.logical_output_size = 2
    exp = collect(m, snap, constructed)
    obj = json.loads(json.dumps(exp.object_attrs))
    assert obj == {"sc": {"quant_method.kernel.logical_output_size": 2}}  # only what changed, only processed modules
    with torch.device("meta"):
        eng = _with_kernel(Toy())
    seg, _mapped, tensors = transported(exp)
    install(eng, tensors, exp.aliases, exp.reprocess, json.loads(json.dumps(exp.attrs)), obj)
    assert eng.sc.quant_method.kernel.logical_output_size == 2
    for bad, words in [({"quant_method.process_weights_after_loading": 1}, "method"),
                       ({"quant_method.kernel": 1}, "object"), ({"quant_method.nothere.x": 1}, "'nothere'"),
                       ({"training": False}, "would replace")]:
        with torch.device("meta"):
            eng = _with_kernel(Toy())
        with pytest.raises(InstallError, match=words):
            install(eng, tensors, exp.aliases, exp.reprocess, None, {"sc": bad})
    seg.close()


def test_attributes_set_at_construction_follow_the_engine_not_the_daemon():
    """vLLM sets ``do_not_compile`` when it builds the model (True under --enforce-eager): a daemon started without
    it must not hand its False to an eager engine (its first forward failed with `_compiled_callable`). Values
    that loading/post-processing changed still travel."""
    m = Toy()
    m.sc.do_not_compile = False  # the daemon's construction
    constructed = object_states(m)
    snap = snapshot(m)
    m.sc.input_scale = None  # post-processing
    exp = collect(m, snap, constructed)
    assert exp.attrs == {"sc": {"input_scale": None}}
    with torch.device("meta"):
        eng = Toy()
    eng.sc.do_not_compile = True  # the engine's construction
    seg, _mapped, tensors = transported(exp)
    install(eng, tensors, exp.aliases, exp.reprocess, exp.attrs, exp.object_attrs)
    assert eng.sc.do_not_compile is True and eng.sc.input_scale is None
    seg.close()


class OtherKernel:
    __module__ = "vllm.fake_kernels"


def _rebind_scratch(k):
    k.scratch = None  # frees the construction-time tensor: the next one may get its id()
    k.scratch = torch.empty(4)


@pytest.mark.parametrize("change", [
    lambda k: setattr(k, "workspace", torch.ones(3)),  # a tensor bound inside the object
    _rebind_scratch,  # a tensor replaced by another one (possibly at the same address)
    lambda k: setattr(k, "apply_fn", lambda x: x),  # a closure
    lambda k: setattr(k, "parts", [torch.ones(1)]),  # a container of tensors
], ids=["new-tensor", "replaced-tensor", "closure", "list-of-tensors"])
def test_non_plain_state_bound_inside_a_vllm_object_makes_the_module_reprocessed(change):
    """None of these can be exported: the engine re-runs that module's post-processing on the loaded weights
    instead of serving without them."""
    m = _with_kernel(Toy())
    m.sc.quant_method.kernel.scratch = torch.empty(4)
    constructed = object_states(m)
    snap = snapshot(m)
    change(m.sc.quant_method.kernel)
    exp = collect(m, snap, constructed)
    assert "sc" in exp.reprocess and "sc" not in exp.object_attrs


def test_a_replaced_vllm_object_makes_the_module_reprocessed():
    m = _with_kernel(Toy())
    constructed = object_states(m)
    snap = snapshot(m)
    m.sc.quant_method.kernel = OtherKernel()
    assert "sc" in collect(m, snap, constructed).reprocess


def test_install_never_replaces_code_or_unknown_dtypes_inside_objects():
    from vllm_fastload.ipc.memory.state import decode_plain

    m = _with_kernel(Toy())
    exp = collect(m, snapshot(m), object_states(m))
    seg, _mapped, tensors = transported(exp)
    with torch.device("meta"):
        eng = _with_kernel(Toy())
    eng.sc.quant_method.kernel.apply = lambda x: x  # code stored on the instance
    with pytest.raises(InstallError, match="would replace"):
        install(eng, tensors, exp.aliases, exp.reprocess, None, {"sc": {"quant_method.kernel.apply": 0}})
    with pytest.raises(ValueError, match="not a torch dtype: 'load'"):
        decode_plain({"dtype": "load"})
    seg.close()


def test_daemon_finishes_online_quantization_like_vllms_loader(monkeypatch):
    """vLLM's BaseModelLoader.load_model runs finalize_layerwise_processing for online quantization (fp8) before
    post-processing; the daemon, which calls load_weights itself, must do the same (else deferred layers stay on
    the meta device)."""
    from vllm.model_executor.model_loader import reload

    from vllm_fastload.ipc.daemon.export import finish_online_quantization

    calls = []
    monkeypatch.setattr(reload, "finalize_layerwise_processing", lambda m, c: calls.append((m, c)))
    m = Toy()
    assert finish_online_quantization(m, "cfg") is False and calls == []
    m.lin.quant_method.uses_meta_device = True
    assert finish_online_quantization(m, "cfg") is True and calls == [(m, "cfg")]


def test_checksum_windows_match_an_independent_computation():
    """The windows (start, middle, end; consecutive windows for a span shorter than three; short spans padded with
    their last byte) summed as weighted little-endian words, recomputed here in plain Python from the bytes. The GPU
    test compares a CUDA buffer with this path."""
    from vllm_fastload.ipc.memory import layout

    S = layout.SAMPLE
    g = torch.Generator().manual_seed(3)
    buf = torch.randint(0, 256, (8 * S,), dtype=torch.uint8, generator=g)
    raw = buf.numpy().tobytes()
    def at(o, n):
        return TensorRow("uint8", [n], [1], o, n, 0, "param")

    spans = {"long": (0, 3 * S), "short": (3 * S + 5, 9), "none": (0, 0), "two": (4 * S, S + 40),
             "three": (5 * S + 8, 2 * S + 100), "longer": (S, 5 * S + 3)}
    entries = TensorTable.of({k: at(*v) for k, v in spans.items()})

    def window(s, n):
        w = raw[s:s + n] if n > 0 else b""
        if not w:
            return 0
        w = w + w[-1:] * (S - len(w))
        return sum(int.from_bytes(w[8 * j:8 * j + 8], "little") * x for j, x in enumerate(layout._word_weights()))

    def ref(o, n):
        if n == 0:
            return 0
        if n <= S:
            parts = [(o, n)] * 3
        elif n < 3 * S:
            parts = [(o, S), (o + S, min(n - S, S)), (o + 2 * S, n - 2 * S)]
        else:
            last = o + n - S
            parts = [(o, S), (min(max(o + n // 2 - S // 2, o), last), S), (last, S)]
        h = 0
        for s, m in parts:
            h = (h * 0x100000001B3 + window(s, m) % 2**64) % 2**64
        return h

    got = layout.sample_checksums(buf, entries).tolist()
    assert got == [ref(*v) for v in spans.values()]
    assert len(set(got)) == len(spans)


def test_the_checksum_check_imports_nothing_an_engine_would_not():
    """``np.unique`` imports ``numpy.ma`` on its first call, 5-10 ms of an engine's weights phase on the CPU machine
    (nothing else in a vLLM engine imports it); the windows' width classes are found without it. In a fresh
    interpreter, windows of several widths."""
    import subprocess
    import sys

    code = """if True:
        import sys
        import torch
        from vllm_fastload.ipc.memory import layout
        from vllm_fastload.ipc.wire.messages import TensorRow, TensorTable
        assert "numpy.ma" not in sys.modules, "imported before the check"
        rows = {f"t{n}": TensorRow("uint8", [n], [1], 0, n, 0, "param") for n in (3, 9, 40, 100, 300, 2000)}
        layout.sample_checksums(torch.arange(4096, dtype=torch.int64).to(torch.uint8), TensorTable.of(rows))
        print("numpy.ma" in sys.modules)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"


@pytest.mark.parametrize("size", [1, 8, 9, 512, 513, 544, 608, 768, 1024, 1535, 1536])
def test_a_changed_byte_anywhere_in_a_span_of_up_to_three_windows_changes_its_checksum(size):
    """Overlapping windows gave a byte two odd weights, an even sum: flipping its top bit (an fp32/bf16 sign) went
    unseen in some spans between one and three windows (a 544-byte norm of 136 fp32 values). Consecutive windows
    sum every byte once."""
    from vllm_fastload.ipc.memory import layout

    g = torch.Generator().manual_seed(size)
    seg, table = pack({"w": torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)})
    before = layout.sample_checksums(seg.buf, table).tolist()
    missed = []
    for b in range(size):
        for bit in (0x80, 0x01):
            seg.buf[b] ^= bit
            if layout.sample_checksums(seg.buf, table).tolist() == before:
                missed.append((b, bit))
            seg.buf[b] ^= bit
    assert not missed


def test_a_span_beyond_int64_is_named_by_the_checksum_check():
    from vllm_fastload.errors import ManifestError
    from vllm_fastload.ipc.memory import layout

    tb = TensorTable.of({"ok": TensorRow("uint8", [4], [1], 0, 4, 0, "param"),
                         "bad": TensorRow("uint8", [4], [1], 0, 2**64, 0, "param")})
    with pytest.raises(ManifestError, match="'bad' spans"):
        layout.sample_checksums(torch.zeros(1000, dtype=torch.uint8), tb)


@pytest.mark.parametrize("leaf", ["forward", "training_step_property", "lin", "__class__"])
def test_cached_attributes_never_replace_methods_properties_or_submodules(leaf):
    """Attributes come from JSON, but a manifest must not be able to shadow code or modules of the engine's model."""

    class WithProp(Toy):
        @property
        def training_step_property(self):
            return 1

    with torch.device("meta"):
        eng = WithProp()
    with pytest.raises(InstallError, match=f"cached attribute .*{leaf}"):
        install(eng, {}, {}, [], {"": {leaf: None}})


class _OwnDispatch(nn.Parameter):
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _SubParameter(nn.Parameter):
    pass


def _loader(param, loaded):
    param.copy_(loaded)


def _odd_skeleton(case):
    """A one-module skeleton ``c`` for a case the inline path of ``put_tensors`` must treat as ``put`` does."""
    m = nn.Module()
    with torch.device("meta"):
        m.c = c = nn.Module()
        if case in ("tied", "view", "as_buffer", "kept_plain"):
            c.w = nn.Parameter(torch.empty(2))
        if case in ("tied", "kept_plain"):
            c.register_parameter("v", c.w)
        elif case == "view":
            c.keep = c.w.view(2)  # another tensor shares its contents
        elif case == "buffer_as_attr":
            c.register_buffer("b", torch.empty(2))
        elif case == "attr":
            c.a = torch.empty(2)
        elif case in ("dispatch", "subclass", "subclass_shadowing", "kept", "kept_dispatch", "kept_shadowing",
                      "kept_view"):
            cls = _OwnDispatch if case.endswith("dispatch") else _SubParameter
            c.register_parameter("w", cls(torch.empty(2), requires_grad=False))
            # the attributes vLLM's parameter classes carry (set_weight_attrs), which a new object must keep
            vars(c.w).update(output_dim=0, weight_loader=_loader)
            if case == "kept_view":
                c.keep = c.w.view(2)  # another tensor shares its contents: a new object of the class
            if case.endswith("shadowing"):
                vars(c.w)["T"] = "an instance attribute named like one of the class's"
        elif case == "none":
            c.register_parameter("w", None)
            c.register_buffer("b", None)
        elif case == "mismatch":
            c.w = nn.Parameter(torch.empty(3))
    if case == "not_meta":
        m.c.w = nn.Parameter(torch.zeros(2))
    return m


_ODD_CASES = {
    "tied": {"c.w": "param", "c.v": "param"}, "view": {"c.w": "param"}, "as_buffer": {"c.w": "buffer"},
    "buffer_as_attr": {"c.b": "attr"}, "attr": {"c.a": "attr"}, "dispatch": {"c.w": "param"},
    "subclass": {"c.w": "param"}, "subclass_shadowing": {"c.w": "param"}, "none": {"c.w": "param", "c.b": "buffer"},
    "mismatch": {"c.w": "param"},
    "not_meta": {"c.w": "param"},
    # parameters the daemon's post-processing left of their built class: the skeleton's object is kept where it can
    # be (a class with its own dispatch, or a view of it, gets a new object), and a plain skeleton parameter too
    "kept": {"c.w": "kept_param"}, "kept_dispatch": {"c.w": "kept_param"}, "kept_shadowing": {"c.w": "kept_param"},
    "kept_view": {"c.w": "kept_param"}, "kept_plain": {"c.w": "kept_param", "c.v": "kept_param"},
}


@pytest.mark.parametrize("owned", [False, True], ids=["processed", "re-processed"])
@pytest.mark.parametrize("case", sorted(_ODD_CASES))
def test_the_inline_path_of_put_tensors_installs_what_put_installs(case, owned):
    """``_Placer.put_tensors`` repeats ``put``'s and ``_take_over``'s tests inline for speed; this keeps the two
    copies one rule: the same tensors end up in the same places, the same skeleton objects are kept (the same
    exchanges to undo), the same error."""
    from vllm_fastload.ipc.memory.state import _Placer, survey

    def run(inline):
        m = _odd_skeleton(case)
        names = survey(m, set())[0]
        placer = _Placer(names, set())
        if owned:
            placer.owned = set(names)
        before = {k: id(v) for k, v in m.c._parameters.items()} | {k: id(v) for k, v in m.c._buffers.items()}
        by_id = {i: k for k, i in before.items()}
        tensors = {k: (kind, torch.arange(2, dtype=torch.float32)) for k, kind in _ODD_CASES[case].items()}
        error = None
        with torch._C.DisableTorchFunctionSubclass():
            try:
                if inline:
                    placer.put_tensors(tensors)
                else:
                    for full, (kind, t) in tensors.items():
                        placer.put(full, kind, t)
            except InstallError as e:
                error = str(e)
        where = {f"{store}.{k}": None if v is None else (type(v).__name__, v.device.type, tuple(v.shape),
                                                         id(v) == before.get(k), sorted(vars(v).items()))
                 for store, d in (("P", m.c._parameters), ("B", m.c._buffers),
                                  ("A", {k: v for k, v in vars(m.c).items() if isinstance(v, torch.Tensor)}))
                 for k, v in d.items()}
        # the skeleton objects replaced by new ones, which the audit repoints references to
        replaced = sorted((by_id[i], type(v).__name__) for i, v in placer.replaced.items())
        return where, error, len(placer.taken), sorted(placer.installed), replaced, placer.held_elsewhere()

    assert run(inline=True) == run(inline=False)


def test_the_one_walk_of_install_lists_what_named_modules_lists():
    """:func:`state.survey` replaces the ``named_modules`` walks of ``install``: same names, same order, a module
    shared under two names (tied) listed under both, then once; the processing units as
    :func:`state.processing_units` finds them, only when asked for."""
    from vllm_fastload.ipc.memory.state import processing_units, survey

    shared = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    model = torch.nn.Module()
    model.a = torch.nn.ModuleList([torch.nn.Linear(2, 2), shared])
    model.b = torch.nn.ModuleDict({"x": shared, "y": torch.nn.Sequential(torch.nn.Identity())})
    model.register_module("gone", None)  # a child slot set to None: skipped by both
    model.q = Toy()  # lin and sc have quant methods: processing units
    model.process_weights_after_loading = lambda: None  # the model's own hook: "" is a unit
    names, first, units, owned, reached = survey(model, {""})
    assert [(n, id(m)) for n, m in names.items()] == [(n, id(m)) for n, m in
                                                     model.named_modules(remove_duplicate=False)]
    assert [(n, id(m)) for n, m in first] == [(n, id(m)) for n, m in model.named_modules()]
    assert units == processing_units(model) == {"", "q.lin", "q.sc"}
    assert owned == set(names) - {"q.lin", "q.sc"}  # q.lin and q.sc own themselves and are not re-processed
    # the model's hook reaches every module under every name
    assert [(n, m) for n, m, _ in reached] == list(names.items())
    assert [n for n, _, first in reached if first] == [n for n, _ in first]
    assert survey(model, set())[2:] == (set(), set(), [])


def _nested_units_model():
    """A model with units inside units (a quant method module under a layer with a quant method, as vLLM's
    fused-MoE methods are), a unit's module shared under a second name, and plain modules between them."""
    shared = nn.Module()
    shared.quant_method = Scaling()
    model = nn.Module()
    model.layers = nn.ModuleList()
    for _ in range(3):
        layer = nn.Module()
        layer.mlp = nn.Module()
        layer.mlp.quant_method = Scaling()
        layer.mlp.experts = nn.Module()
        layer.mlp.experts.quant_method = _QuantModule()  # a quant method module: a submodule, no unit itself
        layer.mlp.experts.inner = nn.Module()
        layer.mlp.experts.inner.quant_method = Scaling()
        layer.mlp.experts.inner.leaf = nn.Linear(1, 1)
        layer.norm = nn.LayerNorm(1)
        layer.attn = nn.Module()
        layer.attn.proj = nn.Linear(1, 1)
        model.layers.append(layer)
    model.layers[0].attn.shared = shared
    model.layers[2].attn.shared = shared  # the same unit module under a second name: a unit under its first only
    return model


def test_the_module_index_finds_what_named_modules_names_and_install_walks_nothing_when_nothing_is_re_processed(
        monkeypatch):
    """:class:`state.ModuleIndex` resolves a name when asked: every name ``named_modules(remove_duplicate=False)``
    gives (a module shared under two names, a nested one) finds that module, a name no module has (a slot set to
    None, a made-up one, a parameter's name) finds None. An install with nothing to re-process finds the modules
    this way and never walks the model (:func:`state.survey`), and installs what the walk would."""
    from vllm_fastload.ipc.memory import state

    shared = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    model = torch.nn.Module()
    model.a = torch.nn.ModuleList([torch.nn.Linear(2, 2), shared])
    model.b = torch.nn.ModuleDict({"x": shared})
    model.register_module("gone", None)
    index = state.ModuleIndex(model)
    for name, m in reversed(list(model.named_modules(remove_duplicate=False))):  # children asked before parents
        assert index[name] is m and index.get(name) is m
    odd = (".a", ".a.0", "a..0", "a.", ".", "..a", "a.0.", "." * 1200 + "a", "a." * 1200 + "0")
    for missing in ("gone", "gone.x", "a.5", "b.x.0.weight", "nope", *odd):  # no recursion for deep names
        assert index.get(missing) is None and index[missing] is None and missing not in index
    with torch.device("meta"):
        eng = Toy()
    for name in (".sc.weight", "sc..weight", "sc.weight.", "." * 1200 + "w", "sc." * 1200 + "w"):
        # from a helper's attack on 0190eb7: ".sc.weight" was installed over sc.weight, a deep name raised
        # RecursionError (no fallback); each is an InstallError naming the tensor
        with pytest.raises(InstallError, match=r"cached tensor .* has no module"):
            install(eng, {name: ("param", torch.zeros(2, 3))}, {}, [])
        assert eng.sc.weight.is_meta

    def no_walk(*a, **k):
        raise AssertionError("install walked the model with nothing to re-process")

    with torch.device("meta"):
        eng = Toy()
    m = Toy()
    for p in m.parameters():
        p.data.normal_()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    monkeypatch.setattr(state, "survey", no_walk)
    install(eng, {k: ("param" if k in dict(m.named_parameters()) else "buffer", v) for k, v in want.items()}, {}, [])
    assert {k: v.tolist() for k, v in eng.state_dict().items()} == {k: v.tolist() for k, v in want.items()}


def test_the_walk_owns_what_the_nearest_unit_decides_for_every_choice_of_units_to_re_process():
    """:func:`state.survey` tests for processing units only below re-processed ones; what it says each module
    belongs to must still be what the rule says (:func:`state.owner_unit` over :func:`state.processing_units`,
    as the daemon decides it), for every set of units to re-process, nested units and a module shared under two
    names included; and a re-processed name that is not a unit must be missing from its units (the install's
    error)."""
    import itertools

    from vllm_fastload.ipc.memory.state import owner_unit, processing_units, survey

    model = _nested_units_model()
    all_units = processing_units(model)
    assert {"layers.0.mlp", "layers.0.mlp.experts.inner", "layers.0.attn.shared"} <= all_units
    assert "layers.2.attn.shared" not in all_units
    names = [n for n, _ in model.named_modules(remove_duplicate=False)]
    picks = sorted(all_units)
    choices = [set(c) for r in range(3) for c in itertools.combinations(picks, r)]
    for again in choices:
        _, _, units, owned, reached = survey(model, again)
        assert owned == {n for n in names if owner_unit(n, all_units) in again}, again
        assert units <= all_units and again <= units
        assert {n for n, _, _ in reached} == {n for n in names if any(n == a or n.startswith(a + ".") for a in again)}
    _, _, units, _, _ = survey(model, {"layers.1.norm", "layers.2.attn.shared"})
    assert "layers.1.norm" not in units and "layers.2.attn.shared" not in units


def test_member_lookup_finds_what_getattr_finds():
    """``_member`` skips ``nn.Module.__getattr__``'s exception but finds instance attributes, submodules and
    properties like ``getattr`` (vLLM's LoRA fused-MoE layer has a ``quant_method`` property)."""
    from vllm_fastload.ipc.memory.state import _member

    class WithProperty(torch.nn.Module):
        @property
        def quant_method(self):
            return "from-property"

    plain, attr, sub, prop = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), torch.nn.Module(), WithProperty()
    attr.quant_method = "attr"
    sub.quant_method = torch.nn.Identity()
    for m in (plain, attr, sub, prop):
        assert _member(m, "quant_method") is getattr(m, "quant_method", None)


class _Held:
    __module__ = "vllm.fake_state"  # a vLLM object, as far as the state walks are concerned


def _shared_deep_object():
    """``x`` (holding ``x.y.t``, a meta tensor) is reached by module ``A`` only at the walk's depth limit
    (``A.a.b.x``: ``x.y`` is not walked from there) and by module ``B`` directly (``B.x``), after ``A``."""
    y, x, b, a = _Held(), _Held(), _Held(), _Held()
    y.t = torch.empty(2, device="meta")
    x.y, b.x, a.b = y, x, b
    model = nn.Module()
    model.A, model.B = nn.Module(), nn.Module()
    model.A.a, model.B.x = a, x
    return model, y


def test_audit_finds_a_meta_tensor_in_an_object_first_reached_at_the_depth_limit():
    """The walk shares what it visited across modules (a quant method held by every layer is walked once), but an
    object reached nearer to a later module is walked again from there: otherwise ``B.x.y.t`` went unchecked."""
    from vllm_fastload.ipc.memory.state import audit

    model, _ = _shared_deep_object()
    with pytest.raises(InstallError, match=r"^B\.x\.y\.t still refers to a meta-device tensor"):
        audit(model)


def test_repoint_reaches_a_shared_object_first_reached_at_the_depth_limit():
    from vllm_fastload.ipc.memory.state import repoint_stale

    model, y = _shared_deep_object()
    new = torch.zeros(2)
    repoint_stale(model, {id(y.t): new})
    assert y.t is new


def test_module_paths_are_named_modules_without_removing_duplicates():
    """The audit's stack walk gives torch's names and order: a shared module under each path (with its
    subtree), None children left out, the model as ``""``."""
    from vllm_fastload.ipc.memory.state import module_paths

    shared = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
    model = nn.Module()
    model.a = nn.Sequential(nn.Linear(1, 1), shared)
    model.gap = None
    model.register_module("none_child", None)
    model.b = nn.ModuleDict({"x": shared, "y": nn.ModuleList([nn.Identity(), shared])})
    got = module_paths(model)
    want = dict(model.named_modules(remove_duplicate=False))
    assert list(got) == list(want) and all(got[k] is want[k] for k in want)
    assert "b.y.1.0" in got and got["b.y.1.0"] is shared[0]


def test_tensor_refs_lists_every_reference_depth_first():
    """Each tensor a module reaches outside its parameters and buffers, in attributes, dicts, lists and tuples and
    in the vLLM objects below it, with the holder and key that refer to it."""
    from vllm_fastload.ipc.memory.state import _tensor_refs

    t = [torch.full((1,), float(i)) for i in range(6)]  # distinct values: a wrong tensor compares unequal
    obj, inner = _Held(), _Held()
    inner.deep = t[5]
    obj.first, obj.inner, obj.pair = t[2], inner, (t[3], 7)
    m = nn.Linear(1, 1)
    m.cache, m.table, m.parts, m.obj, m.size = t[0], {"k": t[1], "n": 3}, [t[4]], obj, 5
    # a module's own attributes come in set order (its dict less nn.Module's bookkeeping): compare by path
    refs = {path: (holder, key, x) for path, holder, key, x in _tensor_refs(m)}
    assert refs == {"cache": (m, "cache", t[0]), "table['k']": (m.table, "k", t[1]), "parts[0]": (m.parts, 0, t[4]),
                    "obj.first": (obj, "first", t[2]), "obj.inner.deep": (inner, "deep", t[5]),
                    "obj.pair[0]": (obj.pair, 0, t[3])}
    order = [path for path, _, _, _ in _tensor_refs(m)]  # below the module: depth first, in attribute order
    assert order.index("obj.first") < order.index("obj.inner.deep") < order.index("obj.pair[0]")


def test_nothing_to_re_process_walks_no_module(monkeypatch):
    """A GPU engine of a dense model re-processes nothing: no walk of its (tens of thousands of) modules."""
    model = nn.Linear(1, 1)

    def walked(*a, **k):
        raise AssertionError("named_modules walked")

    monkeypatch.setattr(model, "named_modules", walked)
    reprocess_modules(model, [], None)


def test_state_objects_are_decided_per_class_as_defined():
    from vllm_fastload.ipc.memory.state import _is_state_object, _state_object

    values = [_Held(), _Held(), torch.zeros(1), nn.Linear(1, 1), len, _shared_deep_object, 3, "s", None, [1],
              type("FakeConfig", (_Held,), {"__module__": "vllm.fake_state"})(), object()]
    assert [_state_object(v) for v in values] == [_is_state_object(v) for v in values]
    assert [_state_object(v) for v in values][:2] == [True, True] and _state_object(values[-2]) is False


def test_an_installed_buffer_keeps_the_persistence_the_model_gave_it():
    """vLLM registers caches such as the rotary embedding's ``cos_sin_cache`` with ``persistent=False``: after the
    mapping they stay out of ``state_dict`` as with the default loader (re-registering made them persistent)."""
    m = nn.Module()
    m.register_buffer("cache", torch.empty(4, device="meta"), persistent=False)
    m.register_buffer("kept", torch.empty(2, device="meta"))
    cache, kept = torch.arange(4.0), torch.ones(2)
    memory = cache.data_ptr(), kept.data_ptr()
    install(m, {"cache": ("buffer", cache), "kept": ("buffer", kept)}, {}, [])
    assert (m.cache.data_ptr(), m.kept.data_ptr()) == memory and m.cache.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert list(m.state_dict()) == ["kept"]


@pytest.mark.parametrize("take_over", [True, False], ids=["skeleton-object-kept", "new-object"])
def test_installed_parameters_carry_the_skeletons_attributes_but_never_over_the_classes_own(take_over, monkeypatch):
    """vLLM hangs ``weight_loader``, ``input_dim``, ``output_dim`` on each parameter (``set_weight_attrs``); the
    installed parameter has them, as the same objects. A parameter class of vLLM's kind defines ``weight_loader``
    as a property: a re-processed module's parameter keeps that class and its property, and still gets the
    skeleton's other attributes. Where torch can exchange tensor contents the skeleton's parameter objects
    themselves hold the mapped memory (their ``__dict__`` as built); without it (``new-object``) new parameters
    get the skeleton's attributes, none over the class's own."""
    from vllm_fastload.ipc.memory import state

    if not take_over:
        monkeypatch.setattr(state, "_SWAP_IMPL", None)
    class WithProperty(nn.Parameter):
        @property
        def weight_loader(self):
            return "the class's"

    def loader(p, w):
        p.copy_(w)

    m = nn.Module()
    m.plain = nn.Module()
    m.plain.weight = nn.Parameter(torch.empty(2, 3, device="meta"), requires_grad=False)
    vars(m.plain.weight).update(weight_loader=loader, input_dim=1, output_dim=0)
    m.typed = nn.Module()
    m.typed.weight = WithProperty(torch.empty(3, device="meta"), requires_grad=False)
    vars(m.typed.weight).update(weight_loader=loader, output_dim=0)  # as a subclass built before the property
    m.typed.quant_method = Scaling()
    skeleton = m.plain.weight, m.typed.weight
    a, b = torch.ones(2, 3), torch.arange(3.0)
    install(m, {"plain.weight": ("param", a), "typed.weight": ("param", b)}, {}, ["typed"])
    p, q = m.plain.weight, m.typed.weight
    assert type(p) is nn.Parameter and p.device.type == "cpu" and torch.equal(p, a) and not p.requires_grad
    assert p.data_ptr() == a.data_ptr() and not p._is_view()  # the mapped memory, as nn.Parameter(a) holds it
    assert vars(p) == {"weight_loader": loader, "input_dim": 1, "output_dim": 0}
    assert type(q) is WithProperty and torch.equal(q, b)
    assert q.weight_loader == "the class's" and q.output_dim == 0
    if take_over:
        assert p is skeleton[0] and q is skeleton[1]
    else:
        assert p is not skeleton[0] and "weight_loader" not in vars(q)


@pytest.mark.parametrize("take_over", [True, False], ids=["skeleton-object-kept", "new-object"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("held", [False, True], ids=["no-holder", "a-list-holds-one"])
def test_install_walks_for_stale_references_only_when_a_replaced_tensor_is_still_referred_to(monkeypatch, held,
                                                                                             tied, take_over):
    """A model whose skeleton tensors nothing else refers to (tied parameters included) needs no walk for stale
    references; one that a module's list still holds does, and the reference ends up on the installed tensor.
    Where the skeleton's objects take the mapped memory in place (``skeleton-object-kept``) nothing is stale, so
    there is no walk at all."""
    from vllm_fastload.ipc.memory import state

    if not take_over:
        monkeypatch.setattr(state, "_SWAP_IMPL", None)
    walks = []
    real = state.repoint_stale
    monkeypatch.setattr(state, "repoint_stale", lambda *a, **k: walks.append(1) or real(*a, **k))
    m = nn.Module()
    m.a, m.b = nn.Linear(2, 2, device="meta"), nn.Linear(2, 2, device="meta")
    m.a.quant_method = m.b.quant_method = Scaling()
    if tied:
        m.b.weight = m.a.weight
    if held:
        vars(m.b)["kept"] = [m.a.bias]
    ts = {f"{x}.{y}": ("param", torch.full((2, 2) if y == "weight" else (2,), float(i)))
          for i, (x, y) in enumerate((x, y) for x in "ab" for y in ("weight", "bias"))}
    aliases = {}
    if tied:
        del ts["b.weight"]
        aliases = {"b.weight": "a.weight"}
    install(m, ts, aliases, ["a", "b"])
    assert walks == ([1] if held and not take_over else [])
    assert m.b.weight is m.a.weight if tied else not torch.equal(m.b.weight, m.a.weight)
    if held:
        assert m.b.kept[0] is m.a.bias and m.a.bias.device.type == "cpu"


def test_a_parameter_class_with_its_own_torch_dispatch_is_installed_as_a_new_object_that_dispatches():
    """A re-processed module's parameter class that defines ``__torch_dispatch__`` needs the Python dispatch key
    that ``_make_subclass`` turns on; the skeleton object given plain contents in place would skip its hook, so
    install makes a new parameter of that class instead, and operations on it reach the hook."""
    class Dispatching(nn.Parameter):
        calls = 0

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            Dispatching.calls += 1
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
                return func(*args, **(kwargs or {}))

    m = nn.Module()
    m.a = nn.Module()
    m.a.weight = Dispatching(torch.empty(3, device="meta"), requires_grad=False)
    m.a.quant_method = Scaling()
    skeleton = m.a.weight
    install(m, {"a.weight": ("param", torch.arange(3.0))}, {}, ["a"])
    w = m.a.weight
    assert type(w) is Dispatching and w is not skeleton
    Dispatching.calls = 0
    assert (w + 1).tolist() == [1.0, 2.0, 3.0] and Dispatching.calls >= 1


def test_a_failed_install_leaves_the_skeletons_objects_on_the_meta_device():
    """An install that fails on a later tensor gives back what it exchanged: a reference to a skeleton tensor that
    outlives the failed mapping (the fallback loader builds another model) must not point into the daemon's
    segment, which the failed mapping unmaps."""
    m = nn.Module()
    m.a = nn.Linear(3, 2, bias=False, device="meta")
    m.register_buffer("b", torch.empty(2, device="meta"))
    kept = [m.a.weight, m.b]
    segment = torch.arange(8.0)
    with pytest.raises(InstallError, match=r"cached tensor 'nope\.x' has no module 'nope'"):
        install(m, {"a.weight": ("param", segment[:6].view(2, 3)), "b": ("buffer", segment[6:]),
                    "nope.x": ("param", segment[:1])}, {}, [])
    assert [t.device.type for t in kept] == ["meta", "meta"] and m.a.weight is kept[0]
    assert [tuple(t.shape) for t in kept] == [(2, 3), (2,)]


def test_a_meta_tensor_given_to_install_is_refused_by_name():
    """A cached tensor on the meta device (no mapped memory) is refused naming it, and the failed install gives
    back what it exchanged, instead of installing it as meta for the sweep to drop without a word."""
    m = nn.Module()
    m.a = nn.Linear(2, 2, bias=False, device="meta")
    m.register_buffer("b", torch.empty(2, device="meta"))
    kept = m.a.weight
    with pytest.raises(InstallError, match=r"cached tensor 'b' holds no memory \(meta device\)"):
        install(m, {"a.weight": ("param", torch.arange(4.0).view(2, 2)), "b": ("attr", torch.empty(2, device="meta"))},
                {}, [])
    assert m.a.weight is kept and kept.is_meta


def test_installed_tensors_are_not_views_of_the_segment_and_the_given_views_are_untouched():
    """The skeleton's parameter object stays the model's (vLLM's references to it hold) and holds the given view's
    memory, as a detached alias: not an autograd view whose base is the whole segment (installed parameters were
    never views when torch.compile and vLLM's weight handling were checked on the GPU). The given view is left as
    it was."""
    m = nn.Module()
    m.a = nn.Linear(2, 2, bias=False, device="meta")
    kept = m.a.weight
    segment = torch.arange(6.0)
    given = segment.as_strided((2, 2), (2, 1), 2)
    install(m, {"a.weight": ("param", given)}, {}, [])
    assert m.a.weight is kept and kept.data_ptr() == segment[2:].data_ptr()
    assert kept.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    assert not kept._is_view() and kept._base is None
    assert given._is_view() and not given.is_meta and given.data_ptr() == kept.data_ptr()


def test_views_are_plain_aliases_of_the_segment():
    """``views`` makes each tensor below autograd's view tracking: the memory of the segment at its offset, no
    autograd view (no ``_base``), so install may take it over as it is."""
    seg, table = pack({"w": torch.arange(6.0).reshape(2, 3), "s": torch.tensor(7.0)})
    got = views(seg.buf, table)
    for name, t in got.items():
        assert not t._is_view() and t._base is None, name
        assert t.data_ptr() == seg.buf.data_ptr() + table["w" if name == "w" else "s"].offset
    assert got["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and got["s"].item() == 7.0
    seg.buf[table["s"].offset:table["s"].offset + 4].view(torch.float32).fill_(8.0)
    assert got["s"].item() == 8.0  # the segment's memory, not a copy
    seg.close()


@pytest.mark.parametrize("consume", [False, True])
def test_install_consumes_the_given_aliases_only_when_asked(consume):
    """With ``consume`` a given plain alias is exchanged as it is (its object then holds the skeleton's meta
    contents: no detached alias made per tensor); without, the given tensors are left as they were. Either way the
    skeleton's parameter object holds the segment's memory, no autograd view, and a given autograd view is never
    taken over itself."""
    m = nn.Module()
    m.a = nn.Linear(2, 2, bias=False, device="meta")
    m.b = nn.Linear(2, 1, bias=False, device="meta")
    kept = (m.a.weight, m.b.weight)
    seg, table = pack({"a.weight": torch.arange(4.0).reshape(2, 2), "b.weight": torch.ones(1, 2)})
    given = views(seg.buf, table)
    a, view = given["a.weight"], seg.buf[table["b.weight"].offset:].view(torch.float32)[:2].view(1, 2)
    assert view._is_view()
    install(m, {"a.weight": ("param", a), "b.weight": ("param", view)}, {}, [], consume=consume)
    assert (m.a.weight, m.b.weight) == kept
    assert m.a.weight.tolist() == [[0.0, 1.0], [2.0, 3.0]] and m.b.weight.tolist() == [[1.0, 1.0]]
    assert not any(t._is_view() or t.is_meta for t in kept)
    assert m.a.weight.data_ptr() == seg.buf.data_ptr() + table["a.weight"].offset
    assert a.is_meta is consume and tuple(a.shape) == (2, 2)  # consumed: the skeleton's meta contents
    assert view._is_view() and not view.is_meta  # a view is aliased, never taken over itself
    seg.close()


def test_a_failed_install_gives_consumed_aliases_back():
    """``consume`` and a failure on a later tensor: the skeleton's objects are meta again and the given aliases
    hold the segment's memory again."""
    m = nn.Module()
    m.a = nn.Linear(2, 2, bias=False, device="meta")
    seg, table = pack({"a.weight": torch.arange(4.0).reshape(2, 2), "x": torch.ones(1)})
    given = views(seg.buf, table)
    with pytest.raises(InstallError, match=r"cached tensor 'nope\.x' has no module 'nope'"):
        install(m, {"a.weight": ("param", given["a.weight"]), "nope.x": ("param", given["x"])}, {}, [], consume=True)
    assert m.a.weight.is_meta and given["a.weight"].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    seg.close()


def test_the_meta_sweep_of_two_modules_sharing_one_parameter_dict_removes_the_tensor_once():
    """A shallow copy of a module shares its parameter dict: a skeleton tensor post-processing removed is removed
    once (not a ``KeyError`` the fallback policy would not catch), and the cached one installed; by the audit where
    nothing is re-processed, by install where re-processing reaches them (both below a re-processed unit, each
    a processed unit of its own)."""
    import copy

    from vllm_fastload.ipc.memory.state import audit

    for below in (False, True):
        m = nn.Module()
        m.q = nn.Module()
        m.q.quant_method = Scaling()
        m.q.a = nn.Linear(2, 2, device="meta")
        m.q.a.quant_method = Scaling()
        m.q.b = copy.copy(m.q.a)
        assert m.q.b._parameters is m.q.a._parameters
        done = install(m, {"q.a.weight": ("param", torch.arange(4.0).view(2, 2))}, {}, ["q"] if below else [])
        assert ("bias" in m.q.a._parameters) is not below
        audit(m, None, done)
        assert "bias" not in m.q.a._parameters and m.q.b.weight.tolist() == [[0.0, 1.0], [2.0, 3.0]]


class _QuantModule(nn.Module, Packing):
    """A quant method that is also a module (as vLLM's fused-MoE methods are): never a unit itself."""


def _attention_layer_class():
    """A minimal vLLM attention layer class (``AttentionLayerBase``) without a post-processing method of its own."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class Attn(nn.Module, AttentionLayerBase):
        def get_attn_backend(self):
            return None

        def get_kv_cache_spec(self, vllm_config):
            return None

    return Attn


class _QuantProperty(nn.Module):
    @property
    def quant_method(self):
        return Scaling()


def test_the_unit_test_looked_up_per_class_still_answers_per_module(monkeypatch):
    """:func:`state._is_unit` (behind both :func:`state.survey` and :func:`state.processing_units`) decides what
    depends on the class alone once per class; modules of one class that differ (no quant method, one as an
    attribute, one as a submodule, a quant method of the class's property, a quant method module, an attention
    layer with and without a hook of its own) still get their own answer, with the class cache cold and warm,
    whichever instance of a class comes first."""
    from vllm_fastload.ipc.memory import state
    from vllm_fastload.ipc.memory.state import processing_units, survey

    monkeypatch.setattr(state, "_UNIT_CLASSES", {})
    model = nn.Module()
    model.plain = nn.Module()  # plain nn.Module: no quant method
    model.attr = nn.Module()
    model.attr.quant_method = Scaling()
    model.sub = nn.Module()
    model.sub.quant_method = _QuantModule()  # a quant method module as a submodule
    model.none = nn.Module()
    model.none.quant_method = None
    model.prop = _QuantProperty()
    model.qm = _QuantModule()
    model.hooked = nn.Module()
    model.hooked.process_weights_after_loading = lambda: None  # an instance hook: not a deferred attention layer
    model.hooked.quant_method = Scaling()
    attn = _attention_layer_class()
    model.attn = attn()  # an attention layer class without a hook: not deferred
    model.attn_hooked = attn()
    model.attn_hooked.process_weights_after_loading = lambda: None  # with one of its own: a deferred attention layer
    for order in (list, reversed):
        shuffled = nn.Module()
        for k in order(list(model._modules)):
            shuffled.add_module(k, model._modules[k])
        want = processing_units(shuffled)
        assert want == {"attr", "sub", "prop", "hooked", "attn_hooked"}
        shuffled.process_weights_after_loading = lambda: None  # "" re-processed: every module is asked
        assert survey(shuffled, {""})[2] == want | {""}  # cold for the first order, warm for the second
        assert survey(shuffled, {""})[2] == want | {""}
        del shuffled.process_weights_after_loading


def _random_module_graph(rng):
    """A random module tree for the walk's property test: shared modules (no cycles), None slots, ModuleList and
    ModuleDict, units nested in units, quant-method modules, sometimes the model's own hook."""
    mods = [nn.Module()]
    for i in range(rng.randint(3, 12)):
        parent = rng.choice(mods)
        r = rng.random()
        if r < 0.2 and len(mods) > 2:
            child = rng.choice(mods[1:])  # shared under a second name, unless that makes a cycle
            if child is parent or any(c is parent for c in child.modules()):
                continue
        elif r < 0.25:
            parent.register_module(f"n{i}", None)
            continue
        else:
            child = rng.choice([nn.Module, nn.ModuleList, nn.ModuleDict])()
            if rng.random() < 0.35:
                object.__setattr__(child, "quant_method", Scaling())
            elif rng.random() < 0.05:
                child.quant_method = _QuantModule()
        if isinstance(parent, nn.ModuleList):
            parent.append(child)
        else:
            parent.add_module(f"c{i}", child)
        mods.append(child)
    if rng.random() < 0.3:
        mods[0].process_weights_after_loading = lambda: None
    return mods[0]


def test_the_walk_and_the_module_index_agree_with_the_rules_on_random_module_graphs():
    """From a helper's fuzzing of a11c0f5 / 0190eb7, kept as a seeded test: on random module graphs, for every
    choice of up to two units to re-process (and a name that may be none), :func:`state.survey`'s ``owned`` is
    the daemon's rule (:func:`state.owner_unit` over :func:`state.processing_units`), its ``units`` miss exactly
    the re-processed names that are no unit, ``reached`` is every name at or below a re-processed one, and
    :class:`state.ModuleIndex` finds each name's module as ``named_modules`` does."""
    import itertools
    import random

    from vllm_fastload.ipc.memory.state import ModuleIndex, owner_unit, processing_units, survey

    for seed in range(80):
        rng = random.Random(seed)
        model = _random_module_graph(rng)
        named = list(model.named_modules(remove_duplicate=False))
        names = [n for n, _ in named]
        index = ModuleIndex(model)
        assert all(index[n] is m for n, m in reversed(named)), seed
        all_units = processing_units(model)
        picks = sorted(all_units) + [rng.choice(names)]
        for again in (set(c) for r in range(3) for c in itertools.combinations(picks, r)):
            _, _, units, owned, reached = survey(model, again)
            assert owned == {n for n in names if owner_unit(n, all_units) in again}, (seed, again)
            assert units <= all_units and again - units == again - all_units, (seed, again)
            if again <= all_units:
                below = {n for n in names if any(a == "" or n == a or n.startswith(a + ".") for a in again)}
                assert {n for n, _, _ in reached} == below, (seed, again)


@pytest.mark.parametrize("alias", ["a.", "a.sub", "a.flag", "a.forward", "a.training"])
def test_an_alias_torch_refuses_as_a_name_is_an_install_error_and_every_exchange_is_given_back(alias):
    """From a helper's attack of e0ac6da: an alias whose name torch refuses (empty, a submodule's, a plain
    attribute's, a method's) raised a bare ``KeyError`` out of install, which the loader does not turn into a
    fallback; it is an :class:`InstallError` naming the alias, as for a tensor, and the skeleton gets its meta
    contents back."""
    m = nn.Module()
    with torch.device("meta"):
        m.a = nn.Module()
        m.a.register_parameter("w", _SubParameter(torch.empty(2), requires_grad=False))
        m.a.sub = nn.Module()
        m.a.flag = 3
    with pytest.raises(InstallError, match=f"cached alias {alias!r} cannot be installed"):
        install(m, {"a.w": ("kept_param", torch.ones(2))}, {alias: "a.w"}, [])
    assert m.a.w.is_meta and type(m.a.w) is _SubParameter and m.a.flag == 3


def test_an_alias_that_is_a_parameter_in_the_skeleton_stays_a_parameter_when_its_canonical_is_a_buffer():
    """From the same attack: post-processing pointed a parameter at another module's buffer (one memory, exported
    once as the buffer, the parameter an alias). The alias took the canonical tensor's kind, so the engine's
    module held a buffer where the daemon's held a parameter; the skeleton's kind for the name decides."""
    def build():
        m = nn.Module()
        m.x, m.y = nn.Module(), nn.Module()
        m.x.register_buffer("b", torch.zeros(2))
        m.y.register_parameter("w", nn.Parameter(torch.zeros(2), requires_grad=False))
        return m

    with torch.device("meta"):
        eng = build()
    install(eng, {"x.b": ("buffer", torch.arange(2.0))}, {"y.w": "x.b"}, [])
    assert list(eng.y._parameters) == ["w"] and not eng.y._buffers and isinstance(eng.y.w, nn.Parameter)
    assert eng.y.w.data_ptr() == eng.x.b.data_ptr() and eng.y.w.tolist() == [0.0, 1.0]


@pytest.mark.parametrize("case", ["buffer", "missing", "none"])
def test_a_kept_parameter_where_the_skeleton_has_none_is_an_install_error(case):
    """``kept_param`` says the daemon's model built a parameter of that class under the name; a skeleton with a
    buffer there, no such name, or a ``None`` slot is not that model: an :class:`InstallError` (a fallback), on
    the inline path as through ``put``, with the skeleton left as it was."""
    m = nn.Module()
    with torch.device("meta"):
        m.c = nn.Module()
        m.c.w = nn.Parameter(torch.empty(2))
        if case == "buffer":
            m.c.register_buffer("b", torch.empty(2))
        elif case == "none":
            m.c.register_parameter("b", None)
    with pytest.raises(InstallError, match=r"cached tensor 'c.b' is a parameter the daemon's model built there"):
        install(m, {"c.w": ("param", torch.ones(2)), "c.b": ("kept_param", torch.ones(2))}, {}, [])
    assert m.c.w.is_meta and ("b" in m.c._buffers) == (case == "buffer") and "b" not in vars(m.c)
