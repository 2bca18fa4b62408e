"""Small tensors a model's constructor makes from data, built for real in the engine's skeleton as in ``auto``.

vLLM's layers make constants with ``torch.tensor(value)`` while they are built: every attention layer registers
its ``_q_scale``, ``_k_scale``, ``_v_scale`` and ``_prob_scale`` buffers as ``torch.tensor(1.0)`` and keeps
``_k_scale_cpu``, ``_v_scale_cpu`` and an empty ``kv_cache`` the same way
(``vllm/model_executor/layers/attention/attention.py``, ``set_default_quant_scales``, vLLM 0.26 and 0.32). A
default load builds them on the engine's device at construction, outside vLLM's "Loading weights took". An
engine skeleton built on the meta device made them meta too, so each was mapped, checked, viewed and installed
like a weight: seven per attention layer, more than half the tensors of a deep dense model.

The rule, one for both sides (:class:`SmallOnDevice`): a ``torch.tensor(data)`` call without an explicit device
whose result has at most :data:`SMALL_NUMEL` elements is made on the build's real device, in both the daemon's
model and the engine's skeleton; anything else follows the surrounding device context (meta in the skeleton).
Both sides fold those tensors, as they are once the model is built (dtypes and shapes in call order, then bytes),
into one digest, so an engine whose constructor made anything else than the daemon's is refused before it uses
one (:func:`check`).

The daemon (:class:`AsBuilt`) remembers which module buffers and tensor attributes hold such a tensor once the
model is built, and their bytes; at export a name whose tensor still equals that (same kind, class, dtype, shape,
stride, device type and bytes; for a re-processed unit, as it was before post-processing) is not exported: the
engine keeps the one its constructor made. A changed one is exported and installed over the skeleton's in place
(:mod:`.state`); one that post-processing removed is listed in the manifest for the engine to remove.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...errors import CacheUnavailable

#: The most elements a ``torch.tensor`` call's result may have to be made on the real device in a skeleton: the
#: constants layers make (scalars, empty tensors), not data a constructor could hold in bulk.
SMALL_NUMEL = 64


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat ``torch.uint8`` tensor on its device (a copy only when ``t`` is not contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


#: Callers of ``torch.tensor`` whose tensors are not the model's: a module's top level (a constant made when a
#: module is first imported, which may happen during one process's construction and before another's), and
#: ``torch.get_default_device``, which asks an empty ``torch.tensor([])`` for the device (vLLM records that device
#: for each layer while it is built; under the skeleton's meta context it stays meta, as before)
_NOT_THE_MODELS = frozenset({"<module>", "_get_device_with_index"})


class SmallOnDevice(TorchFunctionMode):
    """A torch function mode for the block that builds a model (inside its device context, so that it sees the
    calls first): each ``torch.tensor(data)`` without an explicit device, without ``requires_grad`` or
    ``pin_memory``, whose result has at most :data:`SMALL_NUMEL` elements, is made on ``device`` (a
    ``torch.device``; made on the host, then copied, as ``torch.tensor(data, device=...)`` itself does). ``made``:
    those tensors, in call order. :meth:`digest` folds them into one string. A call that would combine a real
    tensor with meta ones (torch refuses) gets meta copies of the real ones, as in a skeleton without this mode.

    Source of the mechanism: ``torch.overrides.TorchFunctionMode``; the device context manager ``torch.device(...)``
    is itself such a mode (``torch.utils._device.DeviceContext``) and fills ``device`` only where a call gives none.
    """

    def __init__(self, device: Any):
        super().__init__()
        self.device = torch.device(device)
        self.made: list[torch.Tensor] = []
        self._digest: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (func is torch.tensor and kwargs.get("device") is None and not kwargs.get("requires_grad")
                and not kwargs.get("pin_memory") and sys._getframe(1).f_code.co_name not in _NOT_THE_MODELS):
            try:
                host = func(*args, **{**kwargs, "device": "cpu"})
            except (RuntimeError, NotImplementedError):  # data on the meta device (torch.tensor(meta_tensor))
                return func(*args, **kwargs)
            if host.numel() <= SMALL_NUMEL:
                t = host if self.device.type == "cpu" else host.to(self.device)
                self.made.append(t)
                return t
        elif _mixes_meta(args, kwargs):
            # a constructor computing with a small real tensor and the skeleton's meta ones (Phi-3's long-RoPE
            # rescale factors times an arange): done on meta, as the all-meta skeleton did; torch refuses to mix
            # the two (but for host scalars)
            args, kwargs = _to_meta(args), {k: _to_meta(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def digest(self) -> str:
        """``"<count>:<sha256 hex>"`` of the made tensors as they are once the model is built: their dtypes and
        shapes in call order, then their bytes, gathered per dtype and shape (one copy from the device each); the
        same on every side whose constructor ran the same code. Temporaries the constructor dropped count too
        (both sides made them) and stay alive in :attr:`made` until it is dropped: a freed one's memory could be
        reused by another tensor, which would then pass for one of them. Later calls give the same answer."""
        if self._digest is not None:
            return self._digest
        keys = [(t.dtype, t.shape) for t in self.made]
        groups: dict[tuple, list[torch.Tensor]] = {}
        for key, t in zip(keys, self.made):
            groups.setdefault(key, []).append(t)
        h = hashlib.sha256(f"{SMALL_NUMEL}|".encode())
        h.update(repr(keys).encode())
        for group in groups.values():
            h.update(torch.stack(group).reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
        self._digest = f"{len(self.made)}:{h.hexdigest()}"
        return self._digest


def _real(a: Any) -> bool:
    """A tensor not on the meta device that torch would not combine with meta ones (a host scalar it would)."""
    return not a.is_meta and (a.dim() > 0 or a.device.type != "cpu")


def _mixes_meta(args: tuple, kwargs: dict) -> bool:
    """Whether a call's tensors (top level, or in a list or tuple there) are meta and real ones together."""
    meta = real = False
    for a in (*args, *kwargs.values()):
        for x in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(x, torch.Tensor):
                if x.is_meta:
                    meta = True
                elif _real(x):
                    real = True
    return meta and real


def _to_meta(a: Any) -> Any:
    """``a`` with its real tensors (top level or in a list or tuple) replaced by meta ones of the same geometry."""
    if isinstance(a, torch.Tensor):
        return a.to("meta") if not a.is_meta else a
    if type(a) is list or type(a) is tuple:  # not a named tuple, whose constructor takes its fields one by one
        return type(a)(_to_meta(x) for x in a)
    return a


def made_memory(made: list[torch.Tensor]) -> set[int]:
    """The data pointers of the non-empty tensors in ``made``: a parameter built over one of them (another tensor
    object over the same memory) is found by it."""
    return {t.data_ptr() for t in made if t.numel()}


def _meta(t: torch.Tensor) -> tuple:
    return type(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.device.type


@dataclass
class AsBuilt:
    """The daemon's record of the small tensors its model's constructor made (:class:`SmallOnDevice`), taken
    when the model is built: ``names`` (dotted name of a module buffer or tensor attribute holding one ->
    ``(kind, its position in made)``), ``modules`` (module name -> those leaves and the parameters over such a
    tensor, for :attr:`.state.Export.dropped`), ``made`` (the tensors), ``shapes`` (each one's class, dtype, shape,
    stride and device type then), ``before`` (their bytes then, one flat ``torch.uint8`` tensor on their device),
    ``offsets`` (each one's start in it; one more at the end) and ``digest`` (:meth:`SmallOnDevice.digest`)."""

    names: dict[str, tuple[str, int]] = field(default_factory=dict)
    modules: dict[str, list[str]] = field(default_factory=dict)
    made: list[torch.Tensor] = field(default_factory=list)
    shapes: list[tuple] = field(default_factory=list)
    before: Any = None
    offsets: list[int] = field(default_factory=list)
    digest: str = "0:"

    @classmethod
    def of(cls, model: nn.Module, mode: SmallOnDevice) -> AsBuilt:
        """The record of ``model`` just built under ``mode``: every module buffer or tensor attribute (under its
        first module name, as :func:`.state.collect` names tensors) that is one of ``mode.made``."""
        from .state import _own_tensors

        digest = mode.digest()  # first: it keeps the tensors the model refers to
        out = cls(made=list(mode.made), digest=digest)
        position = {id(t): i for i, t in enumerate(out.made)}
        memory = made_memory(out.made)
        for name, m in model.named_modules():
            prefix = name + "." if name else ""
            for leaf, (kind, t) in _own_tensors(m).items():
                if kind == "param":
                    # a parameter over such a tensor (vLLM's KVCacheScaleParameter() wraps torch.tensor(-1.0)) is
                    # real in the skeleton too: always exported, but where post-processing removes it, the engine
                    # must as well
                    if t.numel() and t.data_ptr() in memory:
                        out.modules.setdefault(name, []).append(leaf)
                elif (i := position.get(id(t))) is not None:
                    out.names[prefix + leaf] = (kind, i)
                    out.modules.setdefault(name, []).append(leaf)
        out.shapes = [_meta(t) for t in out.made]
        flats = [_flat_bytes(t) for t in out.made]
        out.offsets = [0]
        for f in flats:
            out.offsets.append(out.offsets[-1] + f.numel())
        out.before = torch.cat(flats) if flats else None
        return out

    def lookup(self, modules: dict[str, nn.Module]) -> dict[str, tuple[str, torch.Tensor]]:
        """The recorded names' ``(kind, tensor)`` in ``modules`` (module name -> module) as they are now; a name
        whose module or tensor is gone is left out."""
        from .state import _own_tensors

        return self.lookup_tables({name: _own_tensors(m) for name in self.modules
                                   if (m := modules.get(name)) is not None})

    def lookup_tables(self, tables: dict[str, dict[str, tuple[str, torch.Tensor]]]
                      ) -> dict[str, tuple[str, torch.Tensor]]:
        """The recorded names' ``(kind, tensor)`` in ``tables`` (module name -> leaf -> ``(kind, tensor)``, as
        :class:`.state.Snapshot` holds them); a name missing there is left out."""
        out = {}
        for name, leaves in self.modules.items():
            own, prefix = tables.get(name), name + "." if name else ""
            if own:
                for leaf in leaves:
                    if leaf in own:
                        out[prefix + leaf] = own[leaf]
        return out

    def unchanged(self, now: dict[str, tuple[str, torch.Tensor]]) -> set[str]:
        """The recorded names whose tensor in ``now`` (dotted name -> ``(kind, tensor)``, as the export sees the
        model at that moment) is still as built: the same kind, and the class, dtype, shape, stride, device type
        and bytes the made tensor had then."""
        same = [(k, i, cur[1]) for k, (kind, i) in self.names.items()
                if (cur := now.get(k)) is not None and cur[0] == kind]
        differs = self._differ([(i, t) for _, i, t in same])
        return {k for (k, _, _), d in zip(same, differs) if not d}

    def changed_made(self) -> set[int]:
        """Ids of the made tensors that differ now from when the model was built: in dtype, shape or device (a
        ``.data`` assignment, a ``resize_``), else in bytes."""
        return {id(t) for t, d in zip(self.made, self._differ(list(enumerate(self.made)))) if d}

    def _differ(self, pairs: list[tuple[int, torch.Tensor]]) -> list[bool]:
        """For each ``(position in made, tensor)``, whether the tensor differs from that made tensor as built: in
        class, dtype, shape, stride or device type, else in bytes (compared on the device in one pass)."""
        out = [_meta(t) != self.shapes[i] for i, t in pairs]
        alike = [(i, t) for (i, t), d in zip(pairs, out) if not d]
        bytes_differ = iter(_segments_differ([self.before[self.offsets[i]:self.offsets[i + 1]] for i, _ in alike],
                                             [_flat_bytes(t) for _, t in alike]))
        return [d or next(bytes_differ) for d in out]


def _segments_differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[bool]:
    """For each pair of equally long flat byte tensors (one device), whether their bytes differ: one comparison
    and one copy to the host for all of them."""
    sizes = [x.numel() for x in a]
    if not sum(sizes):
        return [False] * len(a)
    differs = (torch.cat(a) != torch.cat(b)).cpu().numpy()
    counts = np.concatenate([[0], np.cumsum(differs, dtype=np.int64)])
    ends = np.cumsum(sizes)
    return list(counts[ends] - counts[ends - np.asarray(sizes)] > 0)


class ConstructionMismatch(CacheUnavailable):
    """The engine's model constructor made other small tensors than the daemon's (:func:`check`)."""


def check(daemon: str, engine: str, path: str) -> None:
    """Compare the daemon's :meth:`SmallOnDevice.digest` (the manifest's) with this engine's. Raises
    :class:`ConstructionMismatch` when they differ: the engine would keep constants its constructor made that the
    daemon's model never had (a different vLLM or model code behind an equal fingerprint)."""
    if daemon != engine:
        raise ConstructionMismatch(
            f"this engine's model constructor made other small tensors (count:digest {engine}) than the daemon's at "
            f"{path} ({daemon}): the two do not run the same model code; restart `vllm-fastload preload` with the "
            f"vLLM and model this engine runs")


