"""What a loaded model holds, and how to put it into a skeleton model in another process.

Post-processing (``process_weights_after_loading``) may replace parameters, hang plain tensors on modules, or
build state that is not a tensor at all: on vLLM's CPU backend ``dispatch_cpu_unquantized_gemm`` stores a closure
``layer.cpu_linear`` that may hold a oneDNN / sgl / zentorch packed weight, and may replace ``layer.weight``
with an empty tensor; GPU kernels repack too. Such state cannot cross a process boundary.

The rule, per **processing unit** (a module vLLM's ``process_weights_after_loading`` runs something for: one
with a quant method, a deferred attention layer, the model itself when it has the hook; :func:`processing_units`),
decided by the daemon:

* **processed**: post-processing changed only tensors (parameters, buffers, tensor attributes) and plain values
  -> export the module's tensors *after* post-processing; the engine installs them and runs nothing.
* **reprocess**: post-processing bound a new non-tensor object (closure, handle, kernel object) anywhere in the
  unit (the layer, its quant method, which may itself be a module, as vLLM's fused-MoE methods are, or a module
  below it that no closer unit owns) -> export the tensors of every module the unit owns as they were *before*
  post-processing (the loaded weights); the engine installs them into parameters of the classes its skeleton
  built (vLLM's ``BasevLLMParameter`` subclasses, which kernels' post-processing asserts on) and runs the unit's
  post-processing again on the mapped tensors. Still no disk read. An object bound where no unit owns it cannot
  be rebuilt: the daemon refuses such a model at start (:class:`NotExportable`).

The engine audits what it built before the load counts as done (:func:`repoint_stale`, :func:`audit`): references
that vLLM objects or modules hold to the skeleton's meta tensors (a router's copy of the gate's score bias) are
pointed at the installed tensors (inside re-processed units before their re-processing, elsewhere during the
audit's own walk), no tensor any module reaches may stay on the meta device, and every object
post-processing bound in the daemon (the manifest's ``objects``) must exist again after re-processing; a failed
audit is an :class:`InstallError` (the fallback policy's business), never a model that dies at its first forward.

A unit vLLM post-processes while its weights load (online quantization) is taken as it was when that processing
started (:func:`capture_processing`), so the same rule covers it: its loaded weights are exported and the engine
re-processes it.

:func:`snapshot` (before post-processing) holds references, not copies: memory stays shared unless
post-processing replaced a tensor of a reprocess module.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...errors import CacheUnavailable, FastloadError, ManifestError

if TYPE_CHECKING:
    from .constructed import AsBuilt

_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)


def _plain(v: Any) -> bool:
    if isinstance(v, _PLAIN):
        return True
    if isinstance(v, (tuple, list)):
        return all(_plain(x) for x in v)
    return False


def _own_tensors(m: nn.Module, built: dict[str, type] | None = None,
                 name: str = "") -> dict[str, tuple[str, torch.Tensor]]:
    """Module ``m``'s own tensors, leaf -> ``(kind, tensor)`` (:data:`.messages.KINDS`): parameters (their data),
    buffers and plain tensor attributes. With ``built`` (:func:`parameter_classes`; ``name`` is ``m``'s), a
    parameter still of the class the model built it with is ``kept_param``."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    prefix = name + "." if name else ""
    for leaf, p in m._parameters.items():
        if p is not None:
            kept = built is not None and type(p) is not nn.Parameter and built.get(prefix + leaf) is type(p)
            out[leaf] = ("kept_param" if kept else "param", p.data)
    for leaf, b in m._buffers.items():
        if b is not None:
            out[leaf] = ("buffer", b)
    for leaf, v in vars(m).items():
        # private ones too: vLLM's attention layers keep host copies of their KV-cache scales in _k_scale_cpu,
        # made at construction (on the meta device in an engine's skeleton) and filled by post-processing
        if not leaf.startswith("__") and isinstance(v, torch.Tensor) and leaf not in out:
            out[leaf] = ("attr", v)
    return out


def _objects(m: nn.Module) -> dict[str, int]:
    """Public non-tensor, non-plain attributes of a module (name -> id of the value)."""
    return {k: id(v) for k, v in vars(m).items()
            if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module)) and not _plain(v)}


@dataclass
class Snapshot:
    """References to every module's tensors and object attributes before post-processing."""

    tensors: dict[str, dict[str, tuple[str, torch.Tensor]]] = field(default_factory=dict)
    objects: dict[str, dict[str, int]] = field(default_factory=dict)
    #: modules vLLM had already post-processed while loading (online quantization: ``_already_called_...``) whose
    #: state before that processing was not captured (:func:`capture_processing`): nothing to re-process from
    early: set[str] = field(default_factory=set)


#: the flag vLLM's layer-wise (online) quantization sets on a layer it processed while its weights loaded
#: (vllm/model_executor/layers/quantization/online/*.py, 0.26)
_PROCESSED_FLAG = "_already_called_process_weights_after_loading"

#: module name -> (its own tensors, its objects) at the moment its unit's post-processing started
Captured = dict[str, tuple[dict[str, tuple[str, torch.Tensor]], dict[str, int]]]


def snapshot(model: nn.Module, captured: Captured | None = None) -> Snapshot:
    """Take a :class:`Snapshot` of ``model`` (call between ``load_weights`` and post-processing). Modules in
    ``captured`` (:func:`capture_processing`: post-processed while their weights loaded) are taken as they were
    just before that processing, not as they are now."""
    snap = Snapshot()
    captured = captured or {}
    for name, m in model.named_modules():
        if name in captured:
            snap.tensors[name], snap.objects[name] = captured[name]
            continue
        snap.tensors[name] = _own_tensors(m)
        snap.objects[name] = _objects(m)
        if vars(m).get(_PROCESSED_FLAG) is True:
            snap.early.add(name)
    return snap


@contextmanager
def capture_processing(model: nn.Module, constructed: dict[str, tuple] | None = None) -> Iterator[Captured]:
    """While vLLM loads ``model``'s weights inside this block, record each processing unit's modules (the unit and
    the modules it owns, :func:`owner_unit`) as they were when its quant method's ``process_weights_after_loading``
    started, their own tensors (references) and objects, for the units whose processing bound an object there
    (:func:`_bound_anew`, against ``constructed`` as in :func:`collect`). Yields the record (:data:`Captured`),
    filled as units are processed; pass it to :func:`snapshot`.

    Why: vLLM's online quantization processes a layer inside ``load_weights``, as soon as its last weight arrived
    (``_layerwise_process`` in ``model_loader/reload/layerwise.py``, vLLM 0.26 and 0.32: the online-FP8 fused-MoE
    methods quantize there and build their kernel object). A snapshot after loading would hold only the quantized
    weights and the kernel, which an engine cannot rebuild; with the capture, such a unit is one more re-processed
    unit: the engine installs the loaded weights and quantizes them itself, as vLLM's own loader does. The
    capture holds references, so the daemon keeps those loaded weights (and the quantized ones) until it has
    exported them. A unit whose processing left only tensors and plain values (online FP8 of a dense linear) is
    not kept: it is exported as processed, and its loaded weights are freed as vLLM frees them. Quant methods see
    a wrapper of ``process_weights_after_loading`` in their instance dict during the block only; it is removed on
    exit, also on error."""
    modules = list(model.named_modules())
    units = processing_units(model, modules)
    owned: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, m in modules:
        unit = owner_unit(name, units)
        if unit is not None:
            owned.setdefault(unit, []).append((name, m))
    names = {id(m): name for name, m in modules}
    captured: Captured = {}
    wrappers: dict[int, tuple[Any, Any]] = {}  # id of a quant method -> (it, its wrapper)

    def set_wrappers(on: bool) -> None:
        for qm, fn in wrappers.values():
            if on:
                vars(qm)["process_weights_after_loading"] = fn
            else:
                vars(qm).pop("process_weights_after_loading", None)

    @contextmanager
    def unwrapped() -> Iterator[None]:
        """The wrappers out of the quant methods' dicts: they are no state processing bound."""
        set_wrappers(False)
        try:
            yield
        finally:
            set_wrappers(True)

    def wrap(qm: Any) -> None:
        original = qm.process_weights_after_loading

        def process_weights_after_loading(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
            unit = names.get(id(layer))
            if unit is None or unit in captured:
                return original(layer, *args, **kwargs)
            before = {name: (_own_tensors(m), _objects(m)) for name, m in owned.get(unit, ())}
            result = original(layer, *args, **kwargs)
            with unwrapped():
                if any(_bound_anew(name, m, before[name][1], constructed) for name, m in owned.get(unit, ())):
                    captured.update(before)
            return result

        wrappers[id(qm)] = (qm, process_weights_after_loading)

    modules_by_name = dict(modules)
    for unit in units:
        qm = _member(modules_by_name[unit], "quant_method")
        if (_is_quant_method(qm) and hasattr(qm, "__dict__") and "process_weights_after_loading" not in vars(qm)
                and id(qm) not in wrappers):
            wrap(qm)
    set_wrappers(True)
    try:
        yield captured
    finally:
        set_wrappers(False)


_SKIP = object()


def encode_plain(v: Any) -> Any:
    """JSON form of a plain attribute value (``torch.dtype`` -> ``{"dtype": name}``, tuple -> ``{"tuple": [...]}``);
    :data:`_SKIP` for values that do not cross processes as JSON (devices, objects, non-finite floats)."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else _SKIP
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, (tuple, list)):
        items = [encode_plain(x) for x in v]
        if any(x is _SKIP for x in items):
            return _SKIP
        return {"tuple": items} if isinstance(v, tuple) else items
    return _SKIP


def decode_plain(v: Any) -> Any:
    """Inverse of :func:`encode_plain`. Raises :class:`~vllm_fastload.errors.ManifestError` (a ``ValueError``) for
    a JSON value :func:`encode_plain` never makes."""
    if isinstance(v, dict):
        if "dtype" in v:
            d = getattr(torch, str(v["dtype"]), None)
            if not isinstance(d, torch.dtype):
                raise ManifestError(f"not a torch dtype: {v['dtype']!r}")
            return d
        if not isinstance(v.get("tuple"), list) or len(v) != 1:
            raise ManifestError(f"not an encoded attribute value: {str(v)[:60]}")
        return tuple(decode_plain(x) for x in v["tuple"])
    if isinstance(v, list):
        return [decode_plain(x) for x in v]
    return v


def plain_attrs(m: nn.Module) -> dict[str, Any]:
    """A module's own plain attributes (JSON-encoded), private ones included: post-processing sets flags such as
    ``input_scale = None`` or ``_already_called_process_weights_after_loading = True`` that the engine needs."""
    out = {}
    for k, v in vars(m).items():
        if k.startswith("__") or k == "training":
            continue
        e = encode_plain(v)
        if e is not _SKIP:
            out[k] = e
    return out


#: How deep :func:`object_state` follows objects from a module (quant method -> its kernel -> the kernel's config).
STATE_DEPTH = 3
#: The attributes ``nn.Module.__init__`` sets on every module (hook dicts, ``_parameters``...): torch's
#: bookkeeping, never state post-processing binds; skipped by the walks, which visit every module of the model
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _state_object(v: Any) -> bool:
    """An object whose plain attributes post-processing may set: an instance (with a ``__dict__``) of a vLLM
    class (a class defined in, or derived from one in, a ``vllm`` module), not a tensor, module, class or function.
    Example: online FP8's cutlass kernel keeps ``logical_output_size`` on ``layer.quant_method.fp8_linear``
    (vLLM 0.26, ``kernels/linear/scaled_mm/cutlass.py``), set by ``process_weights_after_loading``. Every test
    depends on the class only, so the answer is decided once per class (the walks ask it for every attribute of
    every module and object, hundreds of thousands of times in a deep model)."""
    cls = type(v)
    known = _STATE_CLASSES.get(cls)
    if known is None:
        known = _STATE_CLASSES[cls] = _is_state_object(v)
    return known


#: class -> whether its instances are state objects (:func:`_state_object`)
_STATE_CLASSES: dict[type, bool] = {}


def _is_state_object(v: Any) -> bool:
    if isinstance(v, (torch.Tensor, nn.Module, type)) or inspect.isroutine(v) or not hasattr(v, "__dict__"):
        return False
    if type(v).__name__.endswith("Config"):  # process-wide settings (VllmConfig, quant configs), not layer state
        return False
    return any(c.__module__.startswith("vllm") for c in type(v).__mro__ if c is not object)


#: Types of attribute values that are neither tensors nor hold any (the tensor walk skips them at once: most of a
#: layer's attributes are sizes, flags and names)
_LEAF_TYPES = frozenset({int, float, bool, str, bytes, type(None), torch.dtype, torch.device})


def _attributes(obj: Any, prefix: str, leaves: bool = True) -> list[tuple[str, Any]]:
    """The attributes of ``obj`` the state walks visit, as ``(name, value)``: never dunders or submodules (each
    module is walked on its own), and at the module itself (``prefix`` empty) not ``nn.Module``'s bookkeeping
    (:data:`_MODULE_INTERNALS`). ``leaves`` False: not the values of :data:`_LEAF_TYPES` either. A list, built in
    one comprehension: the engine's walks ask this of every module and object of the model."""
    d = vars(obj)
    keys = d.keys() - _MODULE_INTERNALS if not prefix else list(d)
    skip = () if leaves else _LEAF_TYPES
    return [(k, v) for k in keys if type(v := d[k]) not in skip and not k.startswith("__")
            and not isinstance(v, nn.Module)]


def _dotted(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def object_state(m: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the vLLM objects hanging off module ``m`` hold, by dotted path
    (``"quant_method.fp8_linear.logical_output_size"``), at most :data:`STATE_DEPTH` objects deep, each object
    visited once per module: ``(plain values as JSON (encode_plain), everything else by reference)``. The
    references (tensors, the objects themselves, closures, containers) let :func:`collect` see what was bound
    anew by identity; they are held, so an ``id`` cannot be reused in between."""
    plain: dict[str, Any] = {}
    refs: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(obj: Any, prefix: str, depth: int) -> None:
        for k, v in _attributes(obj, prefix):
            path = _dotted(prefix, k)
            if _state_object(v):
                if prefix:
                    refs[path] = v
                if depth < STATE_DEPTH and id(v) not in seen:
                    seen.add(id(v))
                    walk(v, path, depth + 1)
            elif not prefix:
                continue  # the module's own attributes: plain_attrs(), _own_tensors() and _objects() cover them
            else:
                e = encode_plain(v)
                if e is _SKIP:
                    refs[path] = v
                else:
                    plain[path] = e

    walk(m, "", 0)
    return plain, refs


def object_states(model: nn.Module) -> dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """Per module: ``(plain_attrs, *object_state)``. The daemon takes it right after building the model, i.e. in
    the state the engine's skeleton starts from, so that only what loading and post-processing changed is
    exported: values set at construction follow the engine's own configuration (vLLM's ``do_not_compile`` is
    False in a daemon started without ``--enforce-eager``; copied onto an eager engine, its first forward failed)."""
    return {name: (plain_attrs(m), *object_state(m)) for name, m in model.named_modules()}


def parameter_classes(model: nn.Module) -> dict[str, type]:
    """Full name -> class of each parameter of ``model`` whose class is a subclass of ``nn.Parameter`` (vLLM's
    ``ModelWeightParameter``...), under each module's first name (``named_modules()``). The daemon takes it right
    after building the model, as :func:`object_states`: the class the engine's skeleton builds under each name."""
    out: dict[str, type] = {}
    for name, m in model.named_modules():
        for leaf, p in m._parameters.items():
            if p is not None and type(p) is not nn.Parameter:
                out[f"{name}.{leaf}" if name else leaf] = type(p)
    return out


class NotExportable(FastloadError):
    """The daemon cannot export this model faithfully: post-processing bound state that no processing unit owns,
    so an engine could not rebuild it. The message names the module, the attribute and the quant method."""


@functools.cache
def _quant_method_base() -> Any:
    """vLLM's ``QuantizeMethodBase``, or None without vLLM (looked up once: this runs per module)."""
    try:
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    except ImportError:
        return None
    return QuantizeMethodBase


@functools.cache
def _deferred_attention_check() -> Any:
    """vLLM's ``is_deferred_attention_layer``, or None (older vLLM, or none; looked up once)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:
        return None
    return is_deferred_attention_layer


def _is_quant_method(v: Any) -> bool:
    """vLLM's ``QuantizeMethodBase`` (also when it is a module, as the fused-MoE methods are); duck-typed without
    vLLM."""
    base = _quant_method_base()
    if base is None:
        return hasattr(v, "process_weights_after_loading") and hasattr(v, "apply")
    known = _QUANT_TYPES.get(type(v))
    if known is None:  # an ABC's isinstance is slow, and this runs twice per module: once per class
        known = _QUANT_TYPES[type(v)] = isinstance(v, base)
    return known


#: Whether a class is a vLLM quant method (:func:`_is_quant_method`'s cache; isinstance depends on the class only).
_QUANT_TYPES: dict[type, bool] = {}


def _is_deferred_attention(m: nn.Module) -> bool:
    """vLLM's ``is_deferred_attention_layer(m)``: in vLLM 0.26 and 0.32 an isinstance test on the class and a
    callable ``process_weights_after_loading``, so the answer is remembered per class unless the module carries
    that name itself (this runs once per module of the model)."""
    check = _deferred_attention_check()
    if check is None:
        return False
    if "process_weights_after_loading" in m.__dict__:
        return bool(check(m))
    known = _DEFERRED_TYPES.get(type(m))
    if known is None:
        known = _DEFERRED_TYPES[type(m)] = bool(check(m))
    return known


#: Whether a class is a deferred attention layer (:func:`_is_deferred_attention`'s cache).
_DEFERRED_TYPES: dict[type, bool] = {}


def _member(m: nn.Module, name: str) -> Any:
    """``getattr(m, name, None)`` without ``nn.Module.__getattr__``'s exception for a module that has no such
    attribute (most modules, when asked for ``quant_method``: thousands of exceptions per model)."""
    d = m.__dict__
    if name in d:
        return d[name]
    if name in d.get("_modules", ()):
        return d["_modules"][name]
    return getattr(m, name, None) if hasattr(type(m), name) else None


def processing_units(model: nn.Module, modules: list[tuple[str, nn.Module]] | None = None) -> set[str]:
    """Names of the modules vLLM's ``process_weights_after_loading`` (``model_loader/utils.py``, vLLM 0.26 and
    0.32) runs something for: a module whose ``quant_method`` is a quant method (not a quant method itself), a
    deferred attention layer, and the model (``""``) when it has a ``process_weights_after_loading`` hook.
    ``modules``: ``model.named_modules()`` when already walked."""
    units = {name for name, m in (modules if modules is not None else model.named_modules()) if _is_unit(m)}
    if hasattr(model, "process_weights_after_loading"):
        units.add("")
    return units


def _is_unit(m: nn.Module) -> bool:
    """Whether vLLM's post-processing runs something for module ``m`` itself (:func:`processing_units`' test):
    not a quant method itself, and a quant method as ``m.quant_method`` or a deferred attention layer. What
    depends on the class alone is looked up once per class (this runs once per module of the model, on the
    engine's load path); a module with a ``process_weights_after_loading`` of its own is asked in full."""
    d = m.__dict__
    if "process_weights_after_loading" in d:
        if _is_quant_method(m):
            return False
        return _is_quant_method(_member(m, "quant_method")) or _is_deferred_attention(m)
    known = _UNIT_CLASSES.get(type(m))
    if known is None:
        known = _UNIT_CLASSES[type(m)] = (_is_quant_method(m), hasattr(type(m), "quant_method"),
                                          _is_deferred_attention(m))
    if known[0]:
        return False
    if known[2]:
        return True
    qm = d.get("quant_method")
    if qm is None and "quant_method" not in d and (known[1] or "quant_method" in d["_modules"]):
        qm = _member(m, "quant_method")
    return qm is not None and _is_quant_method(qm)


#: Per module class, what :func:`_is_unit` needs of it: (a quant method itself, the class has a ``quant_method``
#: attribute, a deferred attention layer).
_UNIT_CLASSES: dict[type, tuple[bool, bool, bool]] = {}


class ModuleIndex(dict):
    """Module name -> module of ``model``, by the names ``named_modules(remove_duplicate=False)`` gives (every path
    to a module; ``""`` the model itself). A name not in the dict is resolved when asked (``index[name]`` or
    :meth:`get`) from its parent's ``_modules`` and kept; a name no module has gives None (and is not kept). So
    an engine that re-processes nothing installs without walking the whole model: only the modules its tensors
    name, and their parents, are looked up."""

    def __init__(self, model: nn.Module):
        super().__init__({"": model})

    def __missing__(self, name: str) -> nn.Module | None:
        # up to the nearest name already known (the model's ``""`` at the latest), then down through ``_modules``;
        # a loop, not recursion: a manifest's name may have any number of segments. An empty segment (``".a"``,
        # ``"a..b"``, ``"a."``) is no module's name.
        path: list[tuple[str, str]] = []
        key = name
        while True:
            parent_name, sep, leaf = key.rpartition(".")
            if not leaf or (sep and not parent_name):
                return None
            path.append((key, leaf))
            m = dict.get(self, parent_name)
            if m is not None:
                break
            key = parent_name
        for key, leaf in reversed(path):
            m = m._modules.get(leaf)
            if m is None:
                return None
            self[key] = m
        return m

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """``index[name]``, or ``default`` where no module has that name."""
        m = self[name]
        return default if m is None else m


def survey(model: nn.Module, again: set[str]) -> tuple[ModuleIndex, list[tuple[str, nn.Module]],
                                                      set[str], set[str], list[tuple[str, nn.Module, bool]]]:
    """One walk of ``model`` for :func:`install`: ``(every name -> module`` in
    ``named_modules(remove_duplicate=False)``'s order and names (pre-order; a module reachable under two names is
    listed under both), ``the first name of each module`` (what ``named_modules()`` yields), ``units``, ``owned``,
    ``seen by re-processing``).

    ``again``: the processing units to re-process. ``owned``: the module names whose :func:`owner_unit` (over
    :func:`processing_units`) is in ``again``, the modules whose tensors must come from the cache as the skeleton
    built them. ``units``: the processing units among the modules where that answer depends on it, the names in
    ``again`` and the modules below one (all of them when ``""``, the model's own hook, is in ``again``); a name of
    ``again`` missing from it is not a processing unit of this model (:func:`_checked_reprocess`). A module
    elsewhere can own nothing re-processed whatever it is, so the unit test (a few attribute lookups) runs for
    the modules under re-processed units only: on vLLM's CPU backend every linear layer is one, the rest of a
    model of thousands of layers is not. ``owned`` is by name, as the daemon's export names tensors; a module
    shared under a second name belongs where its first name puts it (the daemon exports it there, as
    :func:`collect` does). ``seen by re-processing``: ``(name, module, whether name is its first)`` for the
    modules of ``again`` and every module below one, under each of those names (what a unit's re-processing can
    reach; all for ``""``). Each module is walked once per name, with the name path its owner follows, and without
    nested generators: this runs on the engine's load path."""
    names = ModuleIndex(model)
    first: list[tuple[str, nn.Module]] = []
    units: set[str] = set()
    owned: set[str] = set()
    reached: list[tuple[str, nn.Module, bool]] = []
    seen: set[int] = set()
    # (name, module, the parent's place: 0 below no re-processed unit, 1 below one but owned by a closer unit that
    # is not re-processed, 2 owned: its owner unit is in ``again``)
    stack: list[tuple[str, nn.Module, int]] = [("", model, 0)]
    pop, push, add_seen, add_first, is_unit = stack.pop, stack.extend, seen.add, first.append, _is_unit
    while stack:
        name, m, place = pop()
        names[name] = m
        i = id(m)
        fresh = i not in seen
        if fresh:
            add_seen(i)
            add_first((name, m))
        if place or name in again:
            # as processing_units: only a module's first name is a unit; the model with a hook of its own is one
            if fresh and (is_unit(m) or (not name and hasattr(model, "process_weights_after_loading"))):
                units.add(name)
                place = 2 if name in again else 1  # a unit owns itself and what it holds, unless a closer unit does
            if place == 2:
                owned.add(name)
            if place:  # under every name: re-processing reaches a shared module through each
                reached.append((name, m, fresh))
        children = m._modules
        if children:
            prefix = name + "." if name else ""
            push([(prefix + k, c, place) for k, c in reversed(children.items()) if c is not None])
    return names, first, units, owned, reached


def owner_unit(name: str, units: set[str]) -> str | None:
    """The processing unit that owns module ``name``: itself or its nearest ancestor in ``units``; None if none."""
    while True:
        if name in units:
            return name
        if not name:
            return None
        name = name.rpartition(".")[0]


@dataclass
class Export:
    """What the daemon exports: canonical tensors, aliases (name -> canonical name), the processing units to
    re-process, the plain attributes of processed modules (module -> {attribute: JSON value}), the plain values
    that loading and post-processing changed inside vLLM objects of processed modules (module -> {dotted path:
    JSON value}) and the objects post-processing bound (module -> dotted paths), which the engine's re-processing
    must bind again."""

    tensors: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    reprocess: list[str] = field(default_factory=list)
    attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    object_attrs: dict[str, dict[str, Any]] = field(default_factory=dict)
    objects: dict[str, list[str]] = field(default_factory=dict)
    #: how many of the constructor's small tensors were left out because they are still as built (:mod:`.constructed`)
    kept: int = 0
    #: those of them that post-processing removed, which the engine removes too (dotted names)
    dropped: list[str] = field(default_factory=list)


def _changed(now: dict[str, Any], was: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``now`` that ``was`` lacks or holds with another value."""
    return {k: v for k, v in now.items() if k not in was or was[k] != v}


def collect(model: nn.Module, snap: Snapshot, constructed: dict[str, tuple] | None = None,
            built: dict[str, type] | None = None, as_built: AsBuilt | None = None,
            as_built_before: set[str] | None = None) -> Export:
    """Apply the per-unit rule (module docstring) to a post-processed ``model``. Tensors that are the same memory
    (tied weights: same data pointer, dtype, shape, stride) are exported once and aliased. ``constructed``
    (:func:`object_states` taken right after the model was built): only plain attributes of modules and plain
    values inside their vLLM objects that differ now are exported; anything else bound anew inside such an object
    (a tensor, a closure, a replaced object: none can be exported there) makes its unit a reprocess one. Without
    ``constructed`` every plain module attribute is exported. ``built`` (:func:`parameter_classes` taken then too):
    a processed module's parameter still of the class the model built it with is exported as ``kept_param`` (the
    engine keeps its skeleton's object); without it every parameter is ``param``. Raises :class:`NotExportable`
    when an object was bound on a module that no processing unit owns, or on a unit vLLM had already processed
    while loading without :func:`capture_processing` seeing it (the weights re-processing would start from are
    gone).

    ``as_built`` (:class:`.constructed.AsBuilt`, taken when the model was built) with ``as_built_before`` (its
    :meth:`~.constructed.AsBuilt.unchanged` names before post-processing): a small tensor the constructor made is
    not exported where it is still as built (in a re-processed unit: as it was before post-processing, which the
    engine's re-processing starts from), unless another name is an alias of it; one that post-processing removed
    is listed in ``dropped``. Raises :class:`NotExportable` also when such a tensor changed while a vLLM object of
    a processed module refers to it and no exported name holds it: the engine's would keep its constructor's
    value."""
    out = Export()
    units = processing_units(model)
    modules = list(model.named_modules())
    for name, m in modules:
        changed = _bound_anew(name, m, snap.objects.get(name, {}), constructed)
        if not changed:
            continue
        unit = owner_unit(name, units)
        if unit is None:
            raise NotExportable(
                f"post-processing bound {changed[0]!r} on module {_described(name, m)}, which no re-processable "
                f"layer owns, so an engine could not rebuild it from exported tensors; serve this model with "
                f"--load-format runai_streamer (or auto)")
        out.objects[name] = sorted(set(changed))
        if unit not in out.reprocess:
            out.reprocess.append(unit)
    early = sorted(set(out.reprocess) & snap.early)
    if early:  # its loaded (pre-processing) weights are gone: re-processing would quantize quantized weights
        raise NotExportable(
            f"vLLM post-processed module {_described(early[0], dict(modules)[early[0]])} while loading its weights "
            f"(online quantization), not through its quant method's process_weights_after_loading where the daemon "
            f"keeps the loaded weights, and bound objects an engine must rebuild from them, which no longer exist; "
            f"serve this model with --load-format runai_streamer (or auto), or quantize the checkpoint offline")
    now = as_built.unchanged(as_built.lookup(dict(modules))) if as_built is not None else set()
    _export_tensors_and_values(out, modules, units, snap, constructed, built or {}, as_built, now,
                               as_built_before or set())
    if as_built is not None:
        _check_changed_small(out, modules, units, as_built)
    return out


def _check_changed_small(out: Export, modules: list[tuple[str, nn.Module]], units: set[str],
                         as_built: AsBuilt) -> None:
    """Raise :class:`NotExportable` for a small tensor the constructor made that has changed since, that a vLLM
    object of a processed module refers to, and that no exported name holds (:func:`collect`)."""
    changed = as_built.changed_made()
    if not changed:
        return
    exported = {id(t) for _, t in out.tensors.values()}
    memory = {t.data_ptr() for _, t in out.tensors.values() if t.numel()}  # another object over exported memory
    again = set(out.reprocess)
    seen: dict[int, int] = {}
    for name, m in modules:
        if owner_unit(name, units) in again:
            continue  # re-processing rebuilds what the unit's objects hold
        for path, _, _, t in _tensor_refs(m, seen):
            if id(t) in changed and id(t) not in exported and not (t.numel() and t.data_ptr() in memory):
                raise NotExportable(
                    f"{_dotted(name, path)} refers to a small tensor the model's constructor made that changed while "
                    f"loading or post-processing, and no exported name holds it, so an engine would keep the "
                    f"constructor's value; serve this model with --load-format runai_streamer (or auto)")


def _described(name: str, m: nn.Module) -> str:
    """``'name' (Class, quant method Method)`` for messages that name a module."""
    qm = getattr(m, "quant_method", None)
    return f"{name!r} ({type(m).__name__}{', quant method ' + type(qm).__name__ if qm is not None else ''})"


def _bound_anew(name: str, m: nn.Module, before: dict[str, int], constructed: dict[str, tuple] | None) -> list[str]:
    """What loading and post-processing bound on module ``m`` that is no tensor or plain value: its own public
    objects that differ from ``before`` (:func:`_objects` of ``m`` taken earlier), and (with ``constructed``) the
    references inside its vLLM objects that differ from the model as built, by dotted path."""
    changed = [k for k, i in _objects(m).items() if before.get(k) != i]
    if constructed is not None:
        was_refs = constructed.get(name, ({}, {}, {}))[2]
        changed += [p for p, v in object_state(m)[1].items() if p not in was_refs or was_refs[p] is not v]
    return changed


def _export_tensors_and_values(out: Export, modules: list[tuple[str, nn.Module]], units: set[str], snap: Snapshot,
                               constructed: dict[str, tuple] | None, built: dict[str, type],
                               as_built: AsBuilt | None, as_built_now: set[str], as_built_before: set[str]) -> None:
    """Fill ``out``'s tensors and aliases (modules of re-processed units: their snapshot's tensors; the others: as
    they are now, a parameter of the class ``built`` names for it as ``kept_param``), the constructor's small
    tensors left out (``as_built_now`` / ``as_built_before``: the names still as built, for processed and
    re-processed modules) and the plain values of processed modules (:func:`collect`'s docstring)."""
    again = set(out.reprocess)
    seen: dict[tuple, str] = {}
    left_out: dict[str, tuple[str, torch.Tensor]] = {}
    by_module = as_built.modules if as_built is not None else {}
    for name, m in modules:
        if owner_unit(name, units) in again:
            own = snap.tensors.get(name, {})
            as_built_here, processed = as_built_before, False
        else:
            own = _own_tensors(m, built, name)
            as_built_here, processed = as_built_now, True
            was_attrs, was_plain, _ = constructed.get(name, ({}, {}, {})) if constructed is not None else ({}, {}, {})
            attrs = plain_attrs(m) if constructed is None else _changed(plain_attrs(m), was_attrs)
            if attrs:
                out.attrs[name] = attrs
            values = _changed(object_state(m)[0], was_plain) if constructed is not None else {}
            if values:
                out.object_attrs[name] = values
        prefix = name + "." if name else ""
        for leaf, (kind, t) in own.items():
            full = prefix + leaf
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride())) if t.numel() else None
            if key is not None and key in seen:
                out.aliases[full] = seen[key]
                continue
            if key is not None:
                seen[key] = full
            if full in as_built_here:
                left_out[full] = (kind, t)
            else:
                out.tensors[full] = (kind, t)
        if name in by_module:  # a processed module keeps a name post-processing made a plain value (set then)
            out.dropped += [prefix + leaf for leaf in by_module[name]
                            if leaf not in own and not (processed and leaf in vars(m))]
    # a left-out tensor that another name is an alias of is exported after all: an alias needs its canonical
    for canonical in set(out.aliases.values()) & left_out.keys():
        out.tensors[canonical] = left_out.pop(canonical)
    out.kept = len(left_out)


def _names_code(cls: type, leaf: str) -> bool:
    """True when ``leaf`` is a dunder, or a method, property or other descriptor of ``cls``: never replaced by a
    cached attribute."""
    static = inspect.getattr_static(cls, leaf, None)
    return leaf.startswith("__") or callable(static) or hasattr(static, "__get__")


class InstallError(CacheUnavailable):
    """The cached tensors do not fit the engine's model (name, shape or dtype); the message names the tensor.
    A :class:`~vllm_fastload.errors.CacheUnavailable` (the engine loads from disk), and so a ``RuntimeError``."""


def install(model: nn.Module, tensors: dict[str, tuple[str, torch.Tensor]], aliases: dict[str, str],
            reprocess: list[str], attrs: dict[str, dict[str, Any]] | None = None,
            object_attrs: dict[str, dict[str, Any]] | None = None, consume: bool = False,
            made: list[torch.Tensor] | None = None, dropped: list[str] | None = None) -> Installed:
    """Put ``tensors`` (name -> (kind, tensor)) into a skeleton ``model`` built on the meta device.

    Parameters keep the Python attributes of the skeleton's parameter (``weight_loader``, ``output_dim``...), and
    the skeleton's object itself (its class: vLLM's ``ModelWeightParameter``...) where their module is re-processed
    or the daemon's post-processing kept that class (``kept_param``), as a disk load keeps it.
    For reprocess modules each tensor must match the skeleton's shape and dtype (it is pre-post-processing
    state), and every parameter and buffer must be in the cache. Skeleton tensors of other modules that the
    daemon did not export were removed by post-processing and are removed too: here in the modules re-processing
    can see (the re-processed units and every module below one), which must not find them; elsewhere by
    :func:`audit`, which checks every module's tensors anyway, so they are not walked twice. Plain attributes of
    processed modules (``attrs``, JSON as made by :func:`plain_attrs`) are set on the skeleton; they never replace a
    method, property or submodule, nor a skeleton tensor unless the value is ``None`` (post-processing removed it).
    ``object_attrs`` (dotted paths from :func:`collect`) are set on the skeleton's vLLM objects along the same
    path, with the same limits.
    References other objects hold to replaced skeleton tensors (:func:`repoint_stale`) are pointed at the installed
    ones here only inside the modules of re-processed units, whose re-processing may read them (all modules when
    the model-level hook is re-processed); the others are left to :func:`audit`, whose walk of the whole model
    comes anyway, so the model is walked once instead of twice. Returns what :func:`audit` needs for both
    (:class:`Installed`). Raises :class:`InstallError`.

    The tensors of ``tensors`` are left as they were, unless ``consume``: then a given tensor that is no autograd
    view (what :func:`.layout.views` makes) may itself be exchanged with the skeleton's (its object then holds the
    skeleton's meta contents), which saves making a detached alias of each; the caller must drop them after. A
    failed install gives every exchanged one back.

    ``made``: the small tensors the skeleton's constructor made on the real device (:mod:`.constructed`): a cached
    tensor of such a one's name takes its place in place, as one of a meta tensor does (the daemon exports only
    those that changed since construction). ``dropped``: names of such tensors the daemon's post-processing
    removed, removed here too.
    """
    # vLLM's parameter classes define __torch_function__, which every .shape, .dtype and .is_meta of theirs would
    # enter from here: install only reads tensor metadata and moves tensors, so subclass dispatch is off
    with torch._C.DisableTorchFunctionSubclass():
        again = set(reprocess)
        if again:
            names, modules, units, owned, reached = survey(model, again)
            _checked_reprocess(again, units)
        else:  # nothing to re-process (a GPU engine of a dense model): no unit to check or own, no walk
            names, modules, owned, reached = ModuleIndex(model), [], set(), []
        placer = _Placer(names, owned, consume, made or [])
        try:
            placer.put_tensors(tensors)
            placer.put_aliases(aliases)
            _remove(names, dropped or (), placer)
            _drop_meta(reached, placer.owned)
            _set_attrs(placer.modules, attrs or {})
            _set_object_attrs(placer.modules, object_attrs or {})
        except BaseException:
            # the skeleton's objects go back to the meta device: a reference to one that outlives this model (the
            # fallback loader builds another) must not point into a segment the failed mapping is about to unmap
            placer.give_back()
            raise
        placer.taken.clear()
        if placer.held_elsewhere():
            holders = modules if "" in again else [(name, m) for name, m in modules if name in placer.owned]
            repoint_stale(model, placer.replaced, holders)
    return Installed(placer.replaced, placer.installed, None if "" in again else {name for name, _, _ in reached})


@dataclass
class Installed:
    """What :func:`install` leaves to :func:`audit`: ``replaced`` (id of each replaced skeleton tensor -> what
    replaced it, for the references install did not repoint), ``installed`` (each cached name -> the tensor put
    there) and ``swept`` (the modules whose skeleton tensors the daemon did not export install removed; None: all
    of them). In the other modules such a tensor is still on the meta device until the audit removes it."""

    replaced: dict[int, torch.Tensor]
    installed: dict[str, torch.Tensor]
    swept: set[str] | None


def _checked_reprocess(again: set[str], units: set[str]) -> None:
    """Check that each processing unit the daemon marked for re-processing (``again``) is one of this model's
    (``units``, :func:`survey`'s). Raises :class:`InstallError` naming one that is not (re-processing would run
    nothing there: the module would keep pre-processing state)."""
    unknown = sorted(again - units)
    if unknown:
        raise InstallError(f"the daemon marks {unknown[0]!r} for re-processing, but post-processing runs nothing for "
                           f"it in this model (no quant method, attention layer or model hook); the daemon's manifest "
                           f"is not from this model or this vLLM")


class _Placer:
    """Puts cached tensors into the skeleton ``model``: ``modules`` by name, ``owned`` the modules of re-processed
    units (their tensors must match the skeleton's), ``installed`` name -> what was put, ``replaced`` id of a
    skeleton tensor -> what took its place (the skeleton tensors that kept their identity, :func:`_take_over`,
    are not in it: nothing refers to a stale object there)."""

    def __init__(self, modules: ModuleIndex, owned: set[str], consume: bool = False,
                 made: list[torch.Tensor] | None = None):
        self.modules = modules
        self.consume = consume  # put_tensors may exchange a given plain tensor itself (install's ``consume``)
        self.owned = owned
        # the skeleton's real small tensors (install's ``made``): those not yet exchanged are taken over in place
        # like a meta tensor, once; the sets by id and by memory (for a parameter built over one) are made when a
        # skeleton tensor that is not meta is first met, not on every load (tens of thousands of tensors)
        self.made = made or []
        self._fresh: tuple[set[int], set[int]] | None = None
        self.was_fresh: set[int] = set()  # ids of those taken over since (another name of one may be removed)
        self.installed: dict[str, torch.Tensor] = {}
        self.replaced: dict[int, torch.Tensor] = {}
        # the replaced skeleton tensors by id (a tied parameter replaced under two names once), alive until
        # held_elsewhere() was asked
        self._olds: dict[int, torch.Tensor] = {}
        # (skeleton object, the object now holding its meta contents) of each exchange, until install is done
        self.taken: list[tuple[torch.Tensor, torch.Tensor]] = []

    def fresh(self) -> tuple[set[int], set[int]]:
        """The ids and the memory (data pointers) of the skeleton's real small tensors not yet exchanged."""
        if self._fresh is None:
            from .constructed import made_memory

            self._fresh = {id(t) for t in self.made}, made_memory(self.made)
        return self._fresh

    def is_fresh(self, old: torch.Tensor) -> bool:
        """Whether ``old`` (not on the meta device) is one of the skeleton's real small tensors, or a parameter
        over one, not yet exchanged."""
        ids, memory = self.fresh()
        return id(old) in ids or (bool(memory) and old.numel() > 0 and old.data_ptr() in memory)

    def taken_over(self, old: torch.Tensor, ptr: int) -> None:
        """``old`` (whose memory was at ``ptr`` before) was exchanged: it is fresh no more (but was)."""
        ids, memory = self.fresh()
        if id(old) in ids or ptr in memory:
            self.was_fresh.add(id(old))
        ids.discard(id(old))
        memory.discard(ptr)

    def give_back(self) -> None:
        """Undo every exchange :func:`_take_over` made (newest first): the skeleton's objects hold their meta
        contents again."""
        while self.taken:
            old, meta = self.taken.pop()
            _SWAP_IMPL(old, meta)

    def held_elsewhere(self) -> bool:
        """Whether anything besides this placer still refers to a replaced skeleton tensor: a module or object that
        kept a reference at construction (what :func:`repoint_stale` points at the installed tensor). Every such
        reference is a Python reference, counted in the tensor's reference count (CPython ``sys.getrefcount``), so
        when no count is above what this placer's own dict gives, no walk of the model can find one (a count
        above it for another reason only costs the walk). Frees the dict."""
        olds, self._olds = self._olds, {}
        probe = {0: torch.empty(0, device="meta")}
        base = max(sys.getrefcount(t) for t in probe.values())  # the dict, the loop's name, the call's argument
        return any(sys.getrefcount(t) > base for t in olds.values())

    def put_tensors(self, tensors: dict[str, tuple[str, torch.Tensor]]) -> None:
        """Install every ``name -> (kind, tensor)``. Raises :class:`InstallError` naming the first that cannot be.

        The common case, a plain tensor taking the place of the skeleton's meta parameter or plain tensor in place
        (:func:`_take_over`), is :meth:`put` and :func:`_take_over` inline, with their tests: it runs once per
        tensor of the model, and the two calls cost as much as the work (about 1 us per tensor). Anything else goes
        through :meth:`put`; a unit test installs odd cases both ways and asks for the same result, so the two copies
        of the tests stay one rule."""
        modules, owned, installed, taken, swap = self.modules, self.owned, self.installed, self.taken, _SWAP_IMPL
        fresh = bool(self.made)  # the skeleton has real small tensors
        plain, param, consume = torch.Tensor, nn.Parameter, self.consume
        replaced, olds, subclass = self.replaced, self._olds, torch.Tensor._make_subclass
        param_names = _class_names(param)
        for full, (kind, t) in tensors.items():
            if swap is not None and type(t) is plain:
                mod_name, _, leaf = full.rpartition(".")
                m = modules[mod_name]  # no method call: a known name is a plain dict lookup
                if m is not None:
                    mine = mod_name in owned
                    if kind == "param" or kind == "kept_param":
                        old = m._parameters.get(leaf)
                        cls = type(old)
                        fits = cls is param or ((mine or kind == "kept_param") and issubclass(cls, param)
                                                and _plain_dispatch(cls))
                        if not fits and not mine and kind == "param" and issubclass(cls, param) and not t.is_meta:
                            # a processed module's parameter of one of vLLM's classes that the daemon's
                            # post-processing replaced by a plain one (FP8 linear methods...; a daemon that did
                            # not is kept_param): put gives it a new nn.Parameter with the skeleton's attributes,
                            # done here without its two calls per tensor, which cost as much again as the work
                            attrs = old.__dict__
                            if attrs.keys().isdisjoint(param_names):
                                p = m._parameters[leaf] = installed[full] = subclass(param, t, False)
                                if attrs:
                                    p.__dict__.update(attrs)
                                replaced[id(old)] = p
                                olds[id(old)] = old
                                continue
                    else:
                        old = m._buffers.get(leaf)
                        if old is None and kind == "attr":
                            old = m.__dict__.get(leaf)
                            fits = type(old) is plain
                        else:
                            fits = type(old) is plain and kind == "buffer"
                    if (fits and (old.is_meta or (fresh and self.is_fresh(old))) and old._use_count() == 1
                            and not t.is_meta and not (mine and (old.shape != t.shape or old.dtype != t.dtype))):
                        # the model's tensor must not be an autograd view of the whole segment (what torch.compile
                        # and vLLM's weight handling were checked with): a view, or a tensor the caller keeps, is
                        # exchanged through a detached alias of it
                        meta = t if consume and not t._is_view() else t.detach()
                        real = not old.is_meta  # a real small tensor of the skeleton's constructor
                        ptr = old.data_ptr() if real else 0
                        swap(old, meta)
                        taken.append((old, meta))
                        installed[full] = old
                        if real:
                            self.taken_over(old, ptr)
                        continue
            try:
                self.put(full, kind, t)
            except (KeyError, TypeError) as e:  # torch refuses the name (a plain attribute of that name exists)
                raise InstallError(f"cached tensor {full!r} cannot be installed in this model ({e})") from None

    def put_aliases(self, aliases: dict[str, str]) -> None:
        """Install each ``alias -> canonical name`` as the installed canonical tensor. Raises :class:`InstallError`
        for an alias of a tensor that is not in the cache."""
        for alias, canonical in aliases.items():
            if canonical not in self.installed:
                raise InstallError(f"cached alias {alias!r} points at {canonical!r}, which is not in the cache")
            mod_name, _, leaf = alias.rpartition(".")
            m = self.modules.get(mod_name)
            # the alias takes the kind the skeleton gave that name (a tied parameter, a parameter post-processing
            # pointed at another module's buffer, or a module's plain reference to another module's tensor); a
            # name the skeleton lacks takes the canonical tensor's kind
            if m is not None and leaf in m._parameters:
                kind = "param"
            elif m is not None and leaf in m._buffers:
                kind = "buffer"
            elif m is not None and isinstance(vars(m).get(leaf), torch.Tensor):
                kind = "attr"
            else:
                kind = "param" if isinstance(self.installed[canonical], nn.Parameter) else "buffer"
            try:
                self.put(alias, kind, self.installed[canonical])
            except (KeyError, TypeError) as e:  # torch refuses the name, as in put_tensors
                raise InstallError(f"cached alias {alias!r} cannot be installed in this model ({e})") from None

    def put(self, full: str, kind: str, t: torch.Tensor) -> None:
        """Install ``t`` as ``full`` (a dotted name) of ``kind`` ``param``, ``kept_param`` (a parameter that keeps
        the skeleton's class, as one of an owned module does), ``buffer`` or ``attr``, in place of the skeleton's
        tensor of that name. Raises :class:`InstallError` (no such module; a ``kept_param`` where the skeleton has
        no parameter; for an owned module, another shape or dtype than the skeleton's)."""
        keep_class = kind == "kept_param"  # a parameter of the skeleton's class, whether or not its module is owned
        if keep_class:
            kind = "param"
        mod_name, _, leaf = full.rpartition(".")
        m = self.modules.get(mod_name)
        if m is None:
            raise InstallError(f"cached tensor {full!r} has no module {mod_name!r} in this model")
        old = m._parameters.get(leaf) if kind == "param" else m._buffers.get(leaf)
        if keep_class and old is None:
            raise InstallError(f"cached tensor {full!r} is a parameter the daemon's model built there, but this "
                               f"model has none of that name; the daemon's manifest is not from this model")
        if t.is_meta:  # no cached tensor is; installed, it would be swept away or refused later without its name
            raise InstallError(f"cached tensor {full!r} holds no memory (meta device); the daemon's manifest or the "
                               f"mapping is broken")
        if old is None and kind == "attr" and isinstance(vars(m).get(leaf), torch.Tensor):
            old = vars(m)[leaf]
        owned = mod_name in self.owned
        keep_class = keep_class or owned
        if owned and old is not None and (old.shape != t.shape or old.dtype != t.dtype):
            raise InstallError(f"cached tensor {full!r} is {t.dtype} {tuple(t.shape)}, the model expects "
                               f"{old.dtype} {tuple(old.shape)}")
        if old is t:  # an alias of a tensor that kept its skeleton object
            self.installed[full] = old
            return
        if old is not None:
            fresh = bool(self.made) and not old.is_meta and self.is_fresh(old)
            ptr = old.data_ptr() if fresh else 0
            meta = _take_over(old, t, kind, keep_class, m, leaf, fresh)
            if meta is not None:
                self.taken.append((old, meta))
                self.installed[full] = old
                if fresh:
                    self.taken_over(old, ptr)
                return
        if kind == "param" and old is not None:
            # the skeleton's parameter of this name: register_parameter's name checks passed when it was built
            p = m._parameters[leaf] = _as_parameter(t, old, keep_class)
            self.installed[full] = p
        elif kind == "buffer" and old is not None:
            # the skeleton's buffer of this name, likewise; it keeps the persistence the model gave it
            m._buffers[leaf] = self.installed[full] = t
        else:
            m._parameters.pop(leaf, None)
            m._buffers.pop(leaf, None)
            if kind == "param":
                p = _as_parameter(t, old, keep_class)
                m.register_parameter(leaf, p)
                self.installed[full] = p
            elif kind == "buffer":
                m.register_buffer(leaf, t)
                self.installed[full] = t
            else:
                setattr(m, leaf, t)
                self.installed[full] = t
        if old is not None:
            self.replaced[id(old)] = self.installed[full]
            self._olds[id(old)] = old


#: torch's exchange of two tensor objects' contents (``torch.utils.swap_tensors`` ends with it; PyTorch 2.3 on);
#: None where this torch lacks it, and then every tensor is installed as a new object
_SWAP_IMPL = getattr(torch._C, "_swap_tensor_impl", None)


def _take_over(old: torch.Tensor, t: torch.Tensor, kind: str, owned: bool, m: nn.Module,
               leaf: str, fresh: bool = False) -> torch.Tensor | None:
    """Make the skeleton's meta tensor ``old`` (``m``'s ``leaf`` of ``kind``) the mapped tensor ``t`` in place,
    keeping the Python object: its class and its attributes (``weight_loader``...) are what a new object would be
    given anyway, and every reference vLLM's objects took to it at construction now sees the mapped memory, so no
    walk has to find and repoint them. Returns the object that now holds ``old``'s meta contents (what undoing it
    exchanges back); None where a new object is the right result (the caller's path): ``old`` not on the meta
    device (already installed under another name) unless ``fresh`` (a small tensor the skeleton's constructor made
    on the real device, not yet exchanged: taken over like a meta one), a parameter class other than the one
    :func:`_as_parameter` would give, a class with its own ``__torch_dispatch__`` (``_make_subclass`` turns on the
    Python dispatch key such a class needs; the exchanged contents would not have it), a buffer or tensor
    attribute of a tensor subclass, a tensor attribute that is not a plain attribute of ``m``, or another tensor
    sharing ``old``'s contents (a view of it: PyTorch's ``swap_tensors`` refuses those too).

    Unlike a new object, the kept one keeps every instance attribute the skeleton gave it, also one named like an
    attribute of its class, which then reads as the skeleton's value: as the same object reads when vLLM's own
    loader fills it.

    The exchange is ``torch.utils.swap_tensors`` without its class, ``__dict__`` and slot exchange (``old`` keeps
    its own) and with its use-count check (a count of 1, no autograd node: these tensors need no grad). ``old``
    takes a detached alias of ``t`` (``t`` may be a tensor the caller keeps, or an installed tensor given again as
    an alias; ``nn.Parameter(t)`` holds such an alias too), so ``t`` itself is left as it was: unlike
    :meth:`_Placer.put_tensors` with ``consume``, this path never takes a given tensor over."""
    if _SWAP_IMPL is None or not (old.is_meta or fresh) or type(t) is not torch.Tensor:
        return None
    if kind == "param":
        if not (type(old) is nn.Parameter or (owned and isinstance(old, nn.Parameter))):
            return None
        if type(old) is not nn.Parameter and not _plain_dispatch(type(old)):
            return None
    elif type(old) is not torch.Tensor:
        return None
    elif kind == "attr" and m.__dict__.get(leaf) is not old:
        return None  # a buffer the daemon exported as a plain attribute: the other path moves it
    if old._use_count() != 1:
        return None
    # a new object over the same memory takes the meta contents, so the caller's ``t`` stays what it was
    meta = t.detach()
    _SWAP_IMPL(old, meta)
    return meta


@functools.cache
def _plain_dispatch(cls: type) -> bool:
    """Whether ``cls`` keeps ``torch.Tensor``'s (disabled) ``__torch_dispatch__``, remembered per class."""
    return getattr(cls, "__torch_dispatch__", None) is torch.Tensor.__torch_dispatch__


def _as_parameter(t: torch.Tensor, old: torch.Tensor | None, owned: bool) -> nn.Parameter:
    """``t`` as the parameter that replaces the skeleton's ``old``, with ``old``'s Python attributes
    (``weight_loader``, ``output_dim``...). ``owned`` (a re-processed module, or a ``kept_param``): of ``old``'s
    parameter class."""
    if type(t) is not torch.Tensor and isinstance(t, nn.Parameter):  # views are plain tensors: skip the slow check
        p = t
    elif owned and isinstance(old, nn.Parameter) and type(old) is not nn.Parameter:
        # pre-processing state: the parameter class the model built (vLLM's BasevLLMParameter subclasses carry the
        # loader's and kernels' metadata; re-processing asserts on them)
        p = torch.Tensor._make_subclass(type(old), t, False)
    elif type(t) is torch.Tensor:  # what nn.Parameter(t, requires_grad=False) does for one, without its frame
        p = torch.Tensor._make_subclass(nn.Parameter, t, False)
    else:
        p = nn.Parameter(t, requires_grad=False)
    attrs = getattr(old, "__dict__", None)
    if attrs:
        mine = vars(p)
        if not mine and attrs.keys().isdisjoint(_class_names(type(p))):
            # the common case (a fresh parameter, no attribute of old's named like one of the class): what the
            # setattr loop below would do, in one call; this runs for every installed parameter
            mine.update(attrs)
        else:
            for k, v in attrs.items():
                if k not in mine and not _class_has(type(p), k):
                    setattr(p, k, v)
    return p


def _class_has(cls: type, name: str) -> bool:
    """``hasattr(cls, name)``, remembered per class and name (a new parameter's attributes are its class's)."""
    key = (cls, name)
    got = _CLASS_HAS.get(key)
    if got is None:
        got = _CLASS_HAS[key] = hasattr(cls, name)
    return got


def _class_names(cls: type) -> frozenset[str]:
    """Every name ``hasattr(cls, name)`` may find (``dir`` of the class and of its metaclass), remembered per
    class: a superset, so a name outside it is surely not the class's."""
    got = _CLASS_NAMES.get(cls)
    if got is None:
        got = _CLASS_NAMES[cls] = frozenset(dir(cls)) | frozenset(dir(type(cls)))
    return got


_CLASS_HAS: dict[tuple[type, str], bool] = {}
_CLASS_NAMES: dict[type, frozenset[str]] = {}


def _drop_meta(modules: list[tuple[str, nn.Module, bool]], owned: set[str]) -> None:
    """Remove the skeleton tensors still on the meta device in ``modules`` (what re-processing can see,
    :func:`survey`'s ``(name, module, first name)``; a module may come under several names): post-processing
    removed them in the daemon, and re-processing (a model-level hook, an attention layer's processing that picks
    its path by which attributes exist) must not see them. Raises :class:`InstallError` for one of a module
    ``owned`` under its first name (re-processed: its tensors must have come from the cache); then nothing is
    removed. Under a second name a module keeps its first name's owner (the daemon's rule, :func:`collect`): a
    processed unit that a re-processed one also holds lost such tensors to its own post-processing."""
    gone = []  # found first, removed after: no copy of each module's dicts to delete from while iterating them
    for name, m, _ in modules:
        params, buffers = m._parameters, m._buffers
        if params:
            for leaf, t in params.items():
                if t is not None and t.is_meta:
                    gone.append((name, m, params, leaf))
        if buffers:
            for leaf, t in buffers.items():
                if t is not None and t.is_meta:
                    gone.append((name, m, buffers, leaf))
    if not gone:
        return
    strict = {id(m) for name, m, first in modules if first and name in owned}
    for name, m, _, leaf in gone:
        if id(m) in strict:
            raise InstallError(f"{name}.{leaf} was not in the cache (its module is re-processed here)")
    for _, _, store, leaf in gone:
        store.pop(leaf, None)  # one module under two names, or two sharing one dict: listed twice


def _remove(modules: ModuleIndex, names: Any, placer: _Placer) -> None:
    """Remove each dotted name (a parameter, buffer or tensor attribute: the daemon's post-processing removed it)
    from the skeleton; a name the skeleton lacks is left. Raises :class:`InstallError` for a name that holds
    anything but a small tensor this engine's constructor made (:meth:`_Placer.is_fresh`): a manifest may not
    remove a weight."""
    for full in names:
        mod_name, _, leaf = full.rpartition(".")
        m = modules.get(mod_name)
        if m is None:
            continue
        for store in (m._parameters, m._buffers, m.__dict__):
            t = store.get(leaf)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.is_meta or not (placer.is_fresh(t) or id(t) in placer.was_fresh):
                raise InstallError(f"the daemon's manifest lists {full!r} as removed by post-processing, but in this "
                                   f"model it is not a small tensor the constructor made; the manifest is not from "
                                   f"this model")
            del store[leaf]
            break


def _set_attrs(modules: dict[str, nn.Module], attrs: dict[str, dict[str, Any]]) -> None:
    """Set the plain attributes (``module -> leaf -> JSON``) on the skeleton's modules; never over a method,
    property or submodule, nor over a tensor unless the value is ``None``. Raises :class:`InstallError`."""
    for mod_name, values in attrs.items():
        m = modules.get(mod_name)
        if m is None:
            raise InstallError(f"cached attributes of module {mod_name!r}, which this model does not have")
        for leaf, enc in values.items():
            if _names_code(type(m), leaf):
                raise InstallError(f"cached attribute {mod_name}.{leaf} would replace a method or property of "
                                   f"{type(m).__name__}; the daemon's manifest is not from this model")
            if leaf in m._modules:
                raise InstallError(f"cached attribute {mod_name}.{leaf} would replace a submodule")
            if leaf in m._parameters or leaf in m._buffers:
                if enc is None and leaf in m._parameters and m._parameters[leaf] is None:
                    continue
                held = m._parameters.get(leaf) if leaf in m._parameters else m._buffers.get(leaf)
                # post-processing replaced a skeleton parameter by None (e.g. input_scale) or by a plain value (a
                # skeleton tensor the cache did not fill is still on the meta device: outside the modules
                # re-processing sees, install leaves those to the audit); a tensor from the cache stays
                if enc is None or (held is not None and held.is_meta):
                    m._parameters.pop(leaf, None)
                    m._buffers.pop(leaf, None)
                else:
                    continue
            object.__setattr__(m, leaf, decode_plain(enc))


def _set_object_attrs(modules: dict[str, nn.Module], object_attrs: dict[str, dict[str, Any]]) -> None:
    """Set the plain attributes of vLLM objects (``module -> dotted path -> JSON``) along the same path in the
    skeleton; only plain values are replaced. Raises :class:`InstallError`."""
    for mod_name, values in object_attrs.items():
        m = modules.get(mod_name)
        if m is None:
            raise InstallError(f"cached object attributes of module {mod_name!r}, which this model does not have")
        for path, enc in values.items():
            *parents, leaf = path.split(".")
            obj: Any = m
            for part in parents:
                obj = vars(obj).get(part)
                if not _state_object(obj):
                    raise InstallError(f"cached attribute {mod_name}.{path}: {part!r} is not a vLLM object of this "
                                       f"model's {mod_name}; the daemon's manifest is not from this model")
            if (not parents or _names_code(type(obj), leaf)
                    or (leaf in vars(obj) and encode_plain(vars(obj)[leaf]) is _SKIP)):  # only plain values replaced
                raise InstallError(f"cached attribute {mod_name}.{path} would replace a method, property, tensor or "
                                   f"object of {type(obj).__name__}; the daemon's manifest is not from this model")
            object.__setattr__(obj, leaf, decode_plain(enc))


def _tensor_refs(m: nn.Module, seen: dict[int, int] | None = None) -> list[tuple[str, Any, str, torch.Tensor]]:
    """Every tensor a module reaches outside its parameters and buffers: its own tensor attributes and the tensor
    attributes of the vLLM objects hanging off it (:func:`object_state`'s walk), also inside lists, tuples and
    dicts there: ``(path, holder, key, tensor)``, depth first, where ``holder[key]`` (a container) or ``holder.key``
    (an object) is the reference. ``seen``: id of each object already walked -> the depth it was walked from,
    shared across the modules of one walk of the model so that an object many modules hold (a quant method, a
    kernel) is walked once (again only when reached nearer to a module, where the depth limit lets the walk go
    further); None: per module. A list filled by plain calls, not nested generators: the audit asks it of every
    module of the model (half of the audit's time went to generator frames)."""
    out: list[tuple[str, Any, str, torch.Tensor]] = []
    _collect_refs(m, "", 0, {} if seen is None else seen, out)
    return out


def _collect_refs(obj: Any, prefix: str, depth: int, seen: dict[int, int],
                  out: list[tuple[str, Any, str, torch.Tensor]]) -> None:
    """:func:`_tensor_refs`' walk of ``obj`` (reached at dotted ``prefix``, ``depth`` objects below the module)."""
    tensor = torch.Tensor
    for k, v in _attributes(obj, prefix, leaves=False):
        if isinstance(v, tensor):
            out.append((_dotted(prefix, k), obj, k, v))
        elif isinstance(v, (dict, list, tuple)):
            for i, x in v.items() if isinstance(v, dict) else enumerate(v):
                if isinstance(x, tensor):
                    out.append((f"{_dotted(prefix, k)}[{i!r}]", v, i, x))
        elif _state_object(v) and depth < STATE_DEPTH and seen.get(id(v), STATE_DEPTH) > depth:
            seen[id(v)] = depth
            _collect_refs(v, _dotted(prefix, k), depth + 1, seen, out)


def module_paths(model: nn.Module) -> dict[str, nn.Module]:
    """Every path to a module of ``model`` -> the module: the names and the order of
    ``dict(model.named_modules(remove_duplicate=False))`` (pre-order, a module reachable under two names under
    both, ``""`` the model), walked with a stack instead of torch's generator per module (a model of tens of
    thousands of modules spent more in those frames than in the work the walk serves)."""
    out: dict[str, nn.Module] = {}
    stack: list[tuple[str, nn.Module]] = [("", model)]
    pop, push = stack.pop, stack.extend
    while stack:
        name, m = pop()
        out[name] = m
        children = m._modules
        if children:
            prefix = name + "." if name else ""
            push([(prefix + k, c) for k, c in reversed(children.items()) if c is not None])
    return out


def repoint_stale(model: nn.Module, replaced: dict[int, torch.Tensor],
                  modules: list[tuple[str, nn.Module]] | None = None) -> None:
    """Point references to replaced skeleton tensors at what replaced them (``replaced``: id of the skeleton's
    tensor -> the installed one): a module or vLLM object that kept a reference to another module's parameter at
    construction (DeepSeek-V3's fused-MoE router holds the gate's ``e_score_correction_bias``) would otherwise
    keep the meta-device original. A reference held in a tuple is rebuilt as a tuple. References :func:`audit`
    cannot resolve stay for it to report. ``modules``: ``model.named_modules()`` when already walked."""
    if not replaced:
        return
    seen: dict[int, int] = {}
    for _, m in modules if modules is not None else model.named_modules():
        if not m.__dict__.keys() - _MODULE_INTERNALS:
            continue  # nothing beyond nn.Module's bookkeeping: no reference to walk
        for _path, holder, key, t in _tensor_refs(m, seen):
            new = replaced.get(id(t))
            if new is not None and t.device.type == "meta":
                _repoint(holder, key, new)  # one held in a tuple stays: audit() names it


def _repoint(holder: Any, key: Any, new: torch.Tensor) -> bool:
    """Make ``holder[key]`` (a dict or list) or ``holder.key`` (an object) refer to ``new``; False for a tuple
    (immutable), which is left as it is."""
    if isinstance(holder, (dict, list)):
        holder[key] = new
    elif isinstance(holder, tuple):
        return False
    else:
        object.__setattr__(holder, key, new)
    return True


def audit(model: nn.Module, objects: dict[str, list[str]] | None = None, done: Installed | None = None) -> None:
    """After install and re-processing, before the engine uses the model: no parameter, buffer or tensor that a
    module or its vLLM objects reach is on the meta device, and every object post-processing bound in the daemon
    (``objects``: module -> dotted paths, the manifest's) is bound again. ``done`` (what :func:`install`
    returned): a reference to a replaced skeleton tensor is pointed at what replaced it on the way (the references
    install left for this walk) instead of being refused, and a skeleton parameter or buffer the daemon did not
    export, in a module install did not sweep, is removed (post-processing removed it; install's docstring). A
    meta tensor under a cached name there was put on the meta device after install: refused, as is any in a
    swept module. Raises :class:`InstallError` naming the first tensor or object that is missing."""
    modules = module_paths(model)
    replaced = done.replaced if done is not None else {}
    installed = done.installed if done is not None else {}
    swept = done.swept if done is not None else None
    seen: dict[int, int] = {}
    for name, m in modules.items():
        for store in (m._parameters, m._buffers):
            for leaf, t in list(store.items()):
                if t is not None and t.device.type == "meta":
                    full = f"{name}.{leaf}" if name else leaf
                    if swept is None or name in swept or full in installed:
                        raise InstallError(f"{full} is still on the meta device after the mapping (not in the cache)")
                    del store[leaf]
        for path, holder, key, t in _tensor_refs(m, seen):
            if t.device.type == "meta":
                new = replaced.get(id(t))
                if new is not None and _repoint(holder, key, new):
                    continue
                raise InstallError(f"{name}.{path} still refers to a meta-device tensor after the mapping: a reference "
                                   f"the cache cannot restore ({type(m).__name__})")
    for mod_name, paths in (objects or {}).items():
        m = modules.get(mod_name)
        if m is None:
            raise InstallError(f"the daemon's post-processing bound objects on module {mod_name!r}, which this model "
                               f"does not have")
        for path in paths:
            obj: Any = m
            for part in path.split("."):
                obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
                if obj is None:
                    break
            if obj is None:
                raise InstallError(f"{mod_name}.{path} was bound by post-processing in the daemon but is missing after "
                                   f"this engine re-processed {type(m).__name__} (re-processing did not rebuild it)")


def reprocess_modules(model: nn.Module, names: list[str], model_config: Any) -> None:
    """Run vLLM's post-processing for the given processing units only (the body of vLLM's
    ``process_weights_after_loading`` loop: quant method, deferred attention layers, the model-level hook), in
    the model's module order, as vLLM runs them."""
    wanted = set(names)
    if not wanted:
        return  # nothing to re-process (a GPU engine of a dense model): no walk of the model
    for name, m in model.named_modules():
        if name not in wanted:
            continue
        qm = getattr(m, "quant_method", None)
        if _is_quant_method(qm) and not _is_quant_method(m):
            qm.process_weights_after_loading(m)
        if _is_deferred_attention(m):
            m.process_weights_after_loading(model_config.dtype)
    if "" in wanted and hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()
