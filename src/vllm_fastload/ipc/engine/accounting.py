"""GPU memory accounting of zero_copy weights: the engine must count memory it maps from the daemon as its own.

vLLM sizes the KV cache as ``gpu_memory_utilization x total memory`` minus what the engine uses (weights,
activations, non-torch memory). In a zero_copy engine the weights were allocated by the daemon, so PyTorch's
allocator of the engine never sees them:

* vLLM >= 0.33 asks the loader ``get_external_weight_memory(vllm_config)`` (``BaseModelLoader``); the
  ``ipc_cache`` loader answers with the bytes it mapped.
* vLLM 0.26 - 0.32 have no such hook: ``GPUModelRunner.load_model`` measures the weights as the growth of
  ``current_platform.get_current_memory_usage()`` (``torch.cuda.max_memory_allocated``) around the loader's
  ``load_model`` (``DeviceMemoryProfiler``). :func:`count_in_vllm_profiler` wraps that class method so the mapped
  bytes are added, and the weights are counted once, inside the engine's share, as with a disk load.

Without this, an engine started with ``--gpu-memory-utilization u`` would take ``u x total`` for itself plus the
daemon's weights on top.
"""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_MAPPED: dict[int, int] = {}


def add_mapped(device_index: int, nbytes: int) -> None:
    """Record ``nbytes`` of daemon memory that this process serves from (zero_copy) on CUDA device ``device_index``."""
    with _LOCK:
        _MAPPED[device_index] = _MAPPED.get(device_index, 0) + int(nbytes)


def mapped_bytes(device_index: int) -> int:
    """Bytes recorded by :func:`add_mapped` for CUDA device ``device_index``."""
    with _LOCK:
        return _MAPPED.get(device_index, 0)


def count_as_weights(device_index: int, nbytes: int) -> None:
    """Count ``nbytes`` on CUDA device ``device_index`` as this engine's weights: recorded for
    ``get_external_weight_memory`` (vLLM >= 0.33) and, on older vLLM, added by the profiler wrapper."""
    add_mapped(device_index, nbytes)
    count_in_vllm_profiler()


def has_external_weight_hook() -> bool:
    """True when vLLM's ``BaseModelLoader`` asks loaders for external weight memory (vLLM >= 0.33)."""
    try:
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    except ImportError:
        return False
    return hasattr(BaseModelLoader, "get_external_weight_memory")


def count_in_vllm_profiler() -> bool:
    """On vLLM without the hook, make ``current_platform.get_current_memory_usage`` include the mapped bytes of
    the device asked about (idempotent). Returns whether the wrapper is in place."""
    if has_external_weight_hook():
        return False
    from vllm.platforms import current_platform

    cls = type(current_platform)
    current = next((b.__dict__["get_current_memory_usage"] for b in cls.__mro__
                    if "get_current_memory_usage" in b.__dict__), None)
    if current is None:
        return False
    original = current.__func__ if isinstance(current, classmethod) else current
    if getattr(original, "_fastload_wrapped", False):
        return True

    def get_current_memory_usage(klass, device=None):  # type: ignore[no-untyped-def]
        import torch

        index = torch.device(device).index if device is not None else None
        if index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return original(klass, device) + mapped_bytes(index)

    get_current_memory_usage._fastload_wrapped = True  # type: ignore[attr-defined]
    cls.get_current_memory_usage = classmethod(get_current_memory_usage)
    return True
