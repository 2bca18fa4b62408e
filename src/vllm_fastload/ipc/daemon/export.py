"""Build and export one rank's model: load it exactly as the engine will, post-process, pack.

The daemon's rank process (:mod:`.main`) calls :func:`build_and_export` once; the result (a segment and its
manifest) is what :mod:`.server` serves. What a model holds and how it is split into exported tensors and
re-processed modules: :mod:`.state`; where each tensor sits in the segment: :mod:`.layout`.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from ...errors import FastloadError
from ...heap import trim_malloc
from ...log import logger
from ..memory.backends import get_transport
from ..memory.layout import fill, place, sample_checksums
from ..memory.transport import Segment, Transport
from ..wire import protocol
from ..wire.messages import KIND_INDEX, Constructed, Manifest, TensorTable


def finish_online_quantization(model: Any, model_config: Any) -> bool:
    """What vLLM's ``BaseModelLoader.load_model`` does between ``load_weights`` and post-processing when a quant
    method quantizes online (``uses_meta_device``, e.g. ``--quantization fp8``): process the layers the layerwise
    loader deferred (attention layers, layers with padding, weights absent from the checkpoint) with
    ``finalize_layerwise_processing``. Like the layerwise quantization during ``load_weights``, this counts as
    loading here: its results are exported as processed. Returns whether it ran (vLLM 0.26 and later)."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_processing
    except ImportError:
        return False
    online = any(getattr(getattr(m, "quant_method", None), "uses_meta_device", False) for m in model.modules())
    if online:
        finalize_layerwise_processing(model, model_config)
    return online


def rank_loader(load_config: Any) -> Any:
    """The model loader of ``load_config`` as a vLLM worker gets it: vLLM's general plugins (this package among
    them) are loaded first, because a rank process started with ``spawn`` has none yet, and ``runai_streamer``
    would resolve to vLLM's built-in loader of that name (``vllm.plugins.load_general_plugins``, idempotent)."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    return get_model_loader(load_config)


def pack(tensors: dict[str, Any], device: Any = None, kinds: Optional[dict[str, str]] = None,
         transport: Optional[Transport] = None) -> tuple[Segment, TensorTable]:
    """Copy ``tensors`` (name -> ``torch.Tensor``) into one new segment on ``device`` (default CPU) made by
    ``transport`` (default: the device's).

    Returns the segment and the manifest's table of its tensors: the :func:`.layout.place` placements, the
    checksum sample of the copied bytes and each tensor's ``kind`` from ``kinds`` (default ``"param"``). Raises
    :class:`.transport.NoTransport` for a device without a transport.
    """
    import torch

    device = torch.device("cpu") if device is None else device
    kinds = kinds or {}
    # the host kinds back to back at the end, so an engine copies them to the host as one span (layout.to_host)
    table, size = place(tensors, last={k for k, kind in kinds.items() if kind.startswith("host_")})
    transport = transport or get_transport(device)
    segment = transport.allocate(size, device)
    fill(segment.buf, tensors, table)
    crcs = sample_checksums(segment.buf, table, transport)
    # the placed table with this segment's checksums and the kinds: same names and geometry, so no new validation
    return segment, table.model_copy(update={"checksum": crcs.tolist(),
                                             "kind": [KIND_INDEX[kinds.get(k, "param")] for k in table.names]})


def build_and_export(vllm_config: Any, local_rank: int, rank: int, world_size: int, init_method: str
                     ) -> tuple[Segment, Manifest, float]:
    """Load this rank's model like the engine does, post-process, pack.

    Returns ``(segment, manifest, seconds)``: the rank's one export buffer, the manifest that describes it and
    the seconds the whole took. Raises :class:`~vllm_fastload.errors.FastloadError` when a tensor was never
    loaded (still on the meta device), :class:`.state.NotExportable` when post-processing bound state no engine
    could rebuild, :class:`.transport.NoTransport` for a device without a transport, and whatever vLLM's loader
    raises."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.platforms import current_platform

    from ...fingerprint import of_model

    t0 = time.perf_counter()
    pc = vllm_config.parallel_config
    mc, lc = vllm_config.model_config, vllm_config.load_config
    device = torch.device(vllm_config.device_config.device if lc.device is None else lc.device)
    transport = get_transport(device)
    transport.bind_rank(local_rank)
    init_distributed_environment(world_size=world_size, rank=rank, distributed_init_method=init_method,
                                 local_rank=local_rank, backend=current_platform.dist_backend)
    with set_current_vllm_config(vllm_config):
        ensure_model_parallel_initialized(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        _, fp = of_model(mc, vllm_config)
        exp, content_digest, small_digest = _processed_export(vllm_config, device)
        device = transport.resolve(device)
        # One export buffer per rank (one fd, one device allocation): engines open one handle and build every
        # tensor by offset. Peak memory during the copy is twice the weights; the model is freed right after.
        tensors = {k: t for k, (_, t) in exp.tensors.items()}
        segment, entries = pack(tensors, device, _kinds(exp.tensors, device), transport)
        del tensors
        exp.tensors.clear()
        _release_dropped_model(transport, device, rank)
    manifest = Manifest(type="manifest", version=protocol.PROTOCOL_VERSION, fingerprint=fp.to_dict(),
                        fingerprint_short=fp.short(), segment=transport.describe(segment, device), tensors=entries,
                        aliases=exp.aliases, reprocess=exp.reprocess, attrs=exp.attrs, object_attrs=exp.object_attrs,
                        objects=exp.objects, content_digest=content_digest,
                        constructed=Constructed(digest=small_digest, kept=exp.kept, dropped=exp.dropped))
    _log_export(rank, entries, exp.reprocess, manifest.constructed)
    return segment, manifest, time.perf_counter() - t0


def _kinds(tensors: dict[str, tuple[str, Any]], device: Any) -> dict[str, str]:
    """Each exported tensor's kind for the table: ``host_`` + its kind where the model keeps it in host memory
    while the rank's device is not the host (the engine puts it back there, as ``auto``'s model has it)."""
    if device.type == "cpu":
        return {k: kind for k, (kind, _) in tensors.items()}
    return {k: "host_" + kind if t.device.type == "cpu" else kind for k, (kind, t) in tensors.items()}


def _release_dropped_model(transport: Transport, device: Any, rank: int) -> Optional[int]:
    """Give back the memory of the model the daemon dropped after packing: collect its reference cycles once
    (vLLM's parameters hold their modules' bound ``weight_loader`` methods, so a dropped model is freed by the cycle
    collector, not when its last name goes), then the device's cached blocks (``transport.free_cached``), then the
    host memory left in the C library's heap (:func:`~vllm_fastload.heap.trim_malloc`; on the CPU about twice the
    segment's size, which the daemon would otherwise keep resident while it serves), with one INFO line. Returns
    the heap bytes handed back (None where they cannot be told). The heap hand-back never raises: the export does
    not depend on it."""
    import gc

    gc.collect()
    transport.free_cached(device)
    t = time.perf_counter()
    try:
        freed = trim_malloc()
    except Exception as e:  # noqa: BLE001 - a memory hand-back must not fail the export
        logger.warning("fastload: rank %d could not return the dropped model's host heap (%s)", rank, e)
        return None
    if freed is not None:
        logger.info("fastload: rank %d returned %.2f GiB of freed host heap to the kernel (malloc_trim) in %.2f s",
                    rank, freed / 2**30, time.perf_counter() - t)
    return freed


def _processed_export(vllm_config: Any, device: Any) -> tuple[Any, Optional[str], str]:
    """Build this rank's model on ``device``, load its weights with the rank's loader (:func:`rank_loader`),
    post-process it and collect what an engine needs (:func:`.state.collect`). Returns ``(export, content digest
    or None, the digest of the small tensors its constructor made)`` (:mod:`..memory.constructed`); the model
    itself is dropped on return (the export holds its tensors). Raises :class:`~vllm_fastload.errors.FastloadError`
    naming a tensor that was never loaded (still on meta)."""
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    from ..memory.constructed import AsBuilt, SmallOnDevice
    from ..memory.state import capture_processing, collect, object_states, parameter_classes, snapshot

    mc = vllm_config.model_config
    loader = rank_loader(vllm_config.load_config)
    with set_default_torch_dtype(mc.dtype):
        # the small tensors the constructor makes from data, by the rule the engine's skeleton follows
        with device, SmallOnDevice(device) as small:
            model = initialize_model(vllm_config=vllm_config, model_config=mc)
            as_built = AsBuilt.of(model, small)
        del small
        constructed = object_states(model)  # what the engine's skeleton will start from
        built = parameter_classes(model)  # likewise its parameters' classes
        # the units vLLM post-processes while loading (online quantization) and that engines must re-process
        with capture_processing(model, constructed) as captured:
            loader.load_weights(model, mc)
            content_digest = getattr(loader, "content_digest", None)  # our runai_streamer with content_hash
            finish_online_quantization(model, mc)
        snap = snapshot(model, captured)
        as_built_before = as_built.unchanged(as_built.lookup_tables(snap.tensors))  # what re-processing starts from
        process_weights_after_loading(model, mc, device)
    exp = collect(model, snap, constructed, built, as_built, as_built_before)
    unloaded = [k for k, (_, t) in exp.tensors.items() if t.device.type == "meta"]
    if unloaded:
        raise FastloadError(f"{len(unloaded)} tensor(s) were never loaded in the daemon (still on the meta "
                            f"device), e.g. {unloaded[0]!r}; this checkpoint/quantization is not supported by the "
                            f"preload daemon yet — serve it with --load-format runai_streamer")
    return exp, content_digest, as_built.digest


def _log_export(rank: int, table: TensorTable, reprocess: list[str], constructed: Constructed) -> None:
    """One INFO line: how many tensors rank ``rank`` exported, their bytes by dtype, how many small tensors the
    model's constructor made were left to each engine's own constructor (``constructed.kept``, as built) or are
    removed by it (``constructed.dropped``), and the layers engines re-process."""
    by_dtype: dict[str, int] = {}
    for j, n in zip(table.dtype, table.nbytes):
        by_dtype[table.dtypes[j]] = by_dtype.get(table.dtypes[j], 0) + n
    logger.info("fastload: rank %d: %d tensors exported as is (bytes by dtype: %s), %d left to the engine's "
                "constructor as built and %d removed there, %d layer(s) re-processed by the engine: %s", rank,
                len(table), ", ".join(f"{d}={n}" for d, n in sorted(by_dtype.items())), constructed.kept,
                len(constructed.dropped), len(reprocess),
                ", ".join(reprocess[:6]) + (" ..." if len(reprocess) > 6 else ""))
