"""Per-tensor costs of `ipc_cache` at 1k / 20k / 100k tensors, phase by phase, on this machine (CPU memfd transport;
the phases are the same code on a GPU, whose segment is mapped instead of an fd).

    python benchmarks/many_tensors.py [--sizes 1000,20000,100000] [--bytes-per-tensor 256] [--device cuda]
                                      [--out OUT.md]

Daemon side: ``pack`` (the export buffer and the manifest's tensor table, with checksum samples), the manifest's
frame (``to_frame`` + JSON); engine side, through the real ``RankServer`` on a Unix socket in this process and
with the garbage collector paused as ``map_model`` pauses it: ``fetch`` (hello, receive, validate the manifest, map
the segment), ``verify`` (checksum samples, the engine's ``_verify``), ``views`` (one tensor per row, the engine's
``_view_tensors``: the table's geometry checked first), ``install`` (into a skeleton module of N parameters on the
meta device) and the fingerprint (:func:`vllm_fastload.fingerprint.Fingerprint.to_dict`); and ``vllm-fastload
inspect`` on one safetensors shard of the same tensors. Prints one Markdown table: seconds per phase (the best of
``--repeat`` runs) and microseconds per tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def tensors(n: int, nbytes: int) -> dict[str, torch.Tensor]:
    """``n`` float32 tensors of ``nbytes`` bytes each, named like a deep model's (``model.layers.i.w``)."""
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i // 8}.m{i % 8}.weight": torch.randn(nbytes // 4, generator=g) for i in range(n)}


def _weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.copy_(loaded)


class Skeleton(nn.Module):
    """One submodule per layer, each with its parameters on the meta device (what the engine builds), each
    parameter with the attributes vLLM's linear layers set on theirs (``set_weight_attrs``: ``input_dim``,
    ``output_dim``, ``weight_loader``), which install carries over."""

    def __init__(self, names: list[str], numel: int, vllm_params: bool = False):
        super().__init__()
        layers: dict[str, nn.Module] = {}
        cls = _vllm_param_class() if vllm_params else nn.Parameter
        for name in names:
            _, _, i, sub, leaf = name.split(".")
            mod = nn.Module()
            p = torch.Tensor._make_subclass(cls, torch.empty(numel, device="meta"), False)
            if vllm_params:  # what BasevLLMParameter's and ModelWeightParameter's __init__ set
                vars(p).update(_input_dim=1, _output_dim=0, _weight_loader=_weight_loader, tp_rank=0, tp_size=1)
            else:
                vars(p).update(input_dim=1, output_dim=0, weight_loader=_weight_loader)
            mod.register_parameter(leaf, p)
            layers.setdefault(i, nn.Module()).add_module(sub, mod)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict(layers)


def _vllm_param_class() -> type:
    """vLLM's ``ModelWeightParameter``, the class of a linear layer's weight in a GPU engine's skeleton (made without
    its ``__init__``, which asks for the tensor-parallel group)."""
    from vllm.model_executor.parameter import ModelWeightParameter

    return ModelWeightParameter


#: Phases that are not the engine's (the engine total leaves them out).
DAEMON_AND_TOOLS = ("pack", "manifest frame", "inspect (headers, no fingerprint)")


def _inspect_cost(ts: dict[str, torch.Tensor]) -> float:
    """Seconds of ``vllm-fastload inspect`` (:func:`vllm_fastload.inspect.inspect`, no fingerprint) on one shard
    holding ``ts``."""
    from safetensors.torch import save_file

    from vllm_fastload.inspect import inspect

    with tempfile.TemporaryDirectory(prefix="fl-many-st-") as d:
        save_file(ts, str(Path(d) / "model.safetensors"))
        t = time.perf_counter()
        rep = inspect(d, with_fingerprint=False)
        took = time.perf_counter() - t
    assert rep["shards"][0]["tensors"] == len(ts), rep
    return took


def run(n: int, nbytes: int, device: torch.device | None = None, vllm_params: bool = False) -> dict[str, float]:
    """Seconds of each phase for ``n`` tensors of ``nbytes`` bytes exported on ``device`` (default CPU: memfd; CUDA:
    the VMM transport, engine and daemon in this one process); ``vllm_params``: the skeleton's parameters of vLLM's
    ``ModelWeightParameter`` class instead of ``nn.Parameter``, exported as ``kept_param`` (as the daemon exports
    them where post-processing kept them)."""
    from tests.conftest import make_fingerprint
    from vllm_fastload.heap import gc_paused
    from vllm_fastload.ipc.daemon.export import pack
    from vllm_fastload.ipc.daemon.rank import RankState
    from vllm_fastload.ipc.daemon.server import RankServer, acquire
    from vllm_fastload.ipc.engine.mapping import _apply_entries, _verify, _view_tensors, fetch
    from vllm_fastload.ipc.memory.backends import get_transport
    from vllm_fastload.ipc.memory.constructed import SmallOnDevice
    from vllm_fastload.ipc.wire import protocol
    from vllm_fastload.ipc.wire.messages import Constructed, Manifest, to_frame

    ts = tensors(n, nbytes)
    out: dict[str, float] = {}
    t = time.perf_counter()
    device = device or torch.device("cpu")
    transport = get_transport(device)
    device = transport.resolve(device)
    # vLLM's classes: what the daemon exports when post-processing kept them (dense GPU models' linear weights)
    seg, entries = pack(ts, device, kinds={k: "kept_param" for k in ts} if vllm_params else None, transport=transport)
    out["pack"] = time.perf_counter() - t
    fp = make_fingerprint()
    manifest = Manifest(version=protocol.PROTOCOL_VERSION, fingerprint=fp.to_dict(), fingerprint_short=fp.short(),
                        constructed=Constructed(digest=SmallOnDevice("cpu").digest(), kept=0),
                        segment=transport.describe(seg, device),
                        tensors=entries)
    t = time.perf_counter()
    frame = json.dumps(to_frame(manifest), separators=(",", ":"))
    out["manifest frame"] = time.perf_counter() - t
    d = Path(tempfile.mkdtemp(prefix="fl-many-"))
    os.chmod(d, 0o700)
    path = d / "cpu-r0.sock"
    lock = acquire(path)
    st = RankState(fingerprint=fp.to_dict(), segment=seg, manifest=manifest, model="m", device=str(device),
                   socket=str(path), load_s=0.0, nbytes=entries.total_bytes())
    st.ready.set()
    srv = RankServer(st, path)
    srv.bind()
    srv.warm(manifest)  # as the daemon does when its load is done
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        with gc_paused():  # as map_model runs the engine's phases
            t = time.perf_counter()
            fd = fp.to_dict()
            out["fingerprint"] = time.perf_counter() - t
            t = time.perf_counter()
            lease = fetch(str(path), fd, 5.0, 60.0, device)
            out["fetch (hello, manifest, map)"] = time.perf_counter() - t
            t = time.perf_counter()
            _verify(lease, str(path))
            out["verify"] = time.perf_counter() - t
            t = time.perf_counter()
            got = _view_tensors(lease, "zero_copy")
            out["views"] = time.perf_counter() - t
            model = Skeleton(list(ts), nbytes // 4, vllm_params)
            t = time.perf_counter()
            _apply_entries(model, got, lease.manifest, [])  # install as the engine calls it
            out["install"] = time.perf_counter() - t
            some = next(iter(ts))
            assert torch.equal(model.get_parameter(some).cpu(), ts[some])
            lease.close()
    finally:
        srv.close()
        th.join(5)
        os.close(lock)
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    out["inspect (headers, no fingerprint)"] = _inspect_cost(ts)
    out["engine total"] = sum(v for k, v in out.items() if k not in DAEMON_AND_TOOLS)
    out["frame MB"] = len(frame) / 1e6
    return out


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and last-level cache (:func:`load_bench.host_cpu`)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from load_bench import host_cpu

    return host_cpu()


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--sizes", default="1000,20000,100000")
    ap.add_argument("--bytes-per-tensor", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="runs per size; each phase's best is printed")
    ap.add_argument("--device", default="cpu", help="cpu (memfd transport) or cuda (VMM transport)")
    ap.add_argument("--vllm-params", action="store_true",
                    help="skeleton parameters of vLLM's ModelWeightParameter (a GPU engine's linear weights, which "
                         "the daemon exports as kept_param and install keeps) instead of nn.Parameter")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    device = torch.device(a.device)
    # warm-up: imports (vLLM's, through install), first-call costs off the table
    run(100, a.bytes_per_tensor, device, a.vllm_params)
    rows = {}
    for n in map(int, a.sizes.split(",")):
        runs = [run(n, a.bytes_per_tensor, device, a.vllm_params) for _ in range(a.repeat)]
        rows[n] = {k: min(r[k] for r in runs) for k in runs[0]}
    phases = [k for k in next(iter(rows.values())) if k != "frame MB"]
    skeleton = "vLLM's ModelWeightParameter" if a.vllm_params else "nn.Parameter"
    lines = [f"{a.device} ({device_name(device)}), {a.bytes_per_tensor}-byte tensors, skeleton parameters of "
             f"{skeleton}; each phase the best of {a.repeat} run(s) per size", "",
             "| phase | " + " | ".join(f"{n} tensors: s (us/tensor)" for n in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for ph in phases:
        lines.append(f"| {ph} | " + " | ".join(f"{r[ph]:.3f} ({r[ph] / n * 1e6:.1f})" for n, r in rows.items()) + " |")
    lines.append("| manifest frame MB | " + " | ".join(f"{r['frame MB']:.1f}" for r in rows.values()) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
