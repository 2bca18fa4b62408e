"""The engine process's garbage-collector heap at the start of a load (``"freeze_gc"``, both load formats).

vLLM's model runner measures the load's device memory with ``DeviceMemoryProfiler`` (``vllm/utils/mem_utils.py``,
vLLM 0.26), which runs a full ``gc.collect()`` when it starts and two when it ends; vLLM 0.26's second model runner
(``vllm/v1/worker/gpu/model_runner.py``) counts all three in "Model loading took". A full collection walks every
object the collector tracks, and a process that imported vLLM and PyTorch tracks millions. vLLM itself freezes the
heap once the engine has started (``freeze_gc_heap`` in ``vllm/utils/gc_utils.py``: collect, then ``gc.freeze()``;
``EngineCore.shutdown`` unfreezes it). Freezing when our load starts does the same earlier: the profiler's first
collection has just run (vLLM builds the loader after it), so what gets frozen is live, and the collections after
the load walk only the objects the load made.
"""

from __future__ import annotations

import gc

from .log import logger


def freeze_heap() -> None:
    """Move every object the cyclic garbage collector tracks now into its permanent generation (``gc.freeze()``;
    Python docs, ``gc``: frozen objects are ignored by every later collection until ``gc.unfreeze()``). Constant
    time; the count of frozen objects is not asked for, because ``gc.get_freeze_count()`` walks them all (tens of
    milliseconds in an engine process)."""
    gc.freeze()
    logger.debug("fastload: froze the garbage collector's heap for the load (freeze_gc)")
