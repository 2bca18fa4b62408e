"""The per-module export rule with toy layers, through the real shared-memory transport (no vLLM server)."""

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402

from vllm_fastload.ipc.shm import pack, tensor_at, verify  # noqa: E402
from vllm_fastload.ipc.state import InstallError, collect, install, reprocess_modules, snapshot  # noqa: E402


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
    import mmap
    import os

    mm = mmap.mmap(os.dup(seg.fd), seg.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    out = {}
    for k, e in entries.items():
        t = tensor_at(mm, e)
        assert verify(t, e)
        out[k] = (exp.tensors[k][0], t)
    return seg, mm, out


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
    buf = torch.frombuffer(seg.mm, dtype=torch.uint8)
    e = entries["sc.weight"]
    buf[e["offset"]] ^= 0xFF
    assert not verify(tensor_at(seg.mm, e), e)
    del buf
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
