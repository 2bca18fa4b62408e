"""The process heap around a load: the garbage collector's at the start of an engine's load (``"freeze_gc"``,
both load formats), and the C library's after the preload daemon dropped its model (:func:`trim_malloc`).

vLLM's model runner measures the load's device memory with ``DeviceMemoryProfiler`` (``vllm/utils/mem_utils.py``,
vLLM 0.26), which runs a full ``gc.collect()`` when it starts and two when it ends; vLLM 0.26's second (default)
GPU model runner (``vllm/v1/worker/gpu/model_runner.py``) counts all three in "Model loading took", the first one
(``gpu_model_runner.py``) counts none but still runs them during the start. A full collection walks every object
the collector tracks, and a process that imported vLLM and PyTorch tracks hundreds of thousands. vLLM itself
freezes the heap once the engine has started (``freeze_gc_heap`` in ``vllm/utils/gc_utils.py``: collect, then
``gc.freeze()``; ``EngineCore.shutdown`` unfreezes it). Freezing when our load starts does the same earlier: the
profiler's first collection has just run (vLLM builds the loader after it), so little garbage is frozen, and the
collections after the load walk only the objects the load made.

The trade-off, as with vLLM's own freeze: an object frozen here that later becomes part of unreachable reference
cycles is not collected until ``gc.unfreeze()`` (vLLM's engine shutdown) or the process's exit, and neither is
what it references. The case that matters is an engine built in a process that outlives a failed start (an
``LLM()`` in a notebook whose start fails after the load: its weights stay allocated until the process ends);
``"freeze_gc": false`` avoids it. A server process exits on a failed start.

The heap is frozen at most once per process (a speculative draft's load, or a second load before vLLM's own
freeze, would otherwise freeze the garbage of the first load), and never on CPU: vLLM's CPU model runner runs no
collections around the load, so there is nothing to gain.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator
from typing import Optional

from .log import logger

_frozen_by_a_load = False


def _collections_around_load() -> bool:
    """Whether vLLM's model runner on this platform runs full collections around the load (not on CPU:
    ``vllm/v1/worker/cpu_model_runner.py`` has no ``DeviceMemoryProfiler``)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover (the loaders need vLLM)
        return False
    return not current_platform.is_cpu()


def freeze_for_load(enabled: bool) -> bool:
    """At the start of a load with ``freeze_gc`` = ``enabled``: move every object the cyclic garbage collector
    tracks into its permanent generation (``gc.freeze()``; Python docs, ``gc``: frozen objects are ignored by every
    later collection until ``gc.unfreeze()``), unless disabled, already done by a load in this process, or on CPU
    (see the module docstring). Returns whether it froze. Constant time; the count of frozen objects is not asked
    for, because ``gc.get_freeze_count()`` walks them all (tens of milliseconds in an engine process)."""
    global _frozen_by_a_load
    if not enabled or _frozen_by_a_load or not _collections_around_load():
        return False
    gc.freeze()
    _frozen_by_a_load = True
    logger.debug("fastload: froze the garbage collector's heap for the load (freeze_gc)")
    return True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (restored after, also on errors), for work that makes
    one object or more per tensor (parsing a safetensors header, mapping a model): enough new objects trigger
    collections, and a full collection walks the whole heap, in an engine process that imported vLLM more than
    the work itself costs, so a header of 100k tensors paid its collections again and again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _rss_anon_bytes() -> Optional[int]:
    """This process's resident anonymous memory in bytes (``RssAnon`` of ``/proc/self/status``), None where the file
    or the field is missing."""
    return proc_kib_field("/proc/self/status", "RssAnon")


def proc_kib_field(path: str, field: str) -> Optional[int]:
    """Field ``field`` of a ``/proc`` file of ``name: value kB`` lines (``/proc/self/status``, ``/proc/meminfo``;
    Linux ``proc(5)``) in bytes, None where the file or the field is missing."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def trim_malloc() -> Optional[int]:
    """Hand the C library's free heap memory back to the kernel: glibc's ``malloc_trim(0)`` (``malloc_trim(3)``:
    since glibc 2.8 it releases the free pages of every arena, not only the top of the heap). Returns about how many
    bytes of resident anonymous memory went (``RssAnon`` before minus after, 0 or more; other threads allocating
    meanwhile count too), or None where the process has no ``malloc_trim`` (musl) or ``/proc`` cannot say. Raises
    nothing. Only what is already free is returned: memory held by reference cycles needs ``gc.collect()`` first.

    Why: a model's tensors on the CPU are ``malloc`` blocks of tens to hundreds of kB. glibc serves blocks above its
    mmap threshold with their own mapping, but raises that threshold to the size of each such block freed (up to
    32 MiB, ``mallopt(3)`` ``M_MMAP_THRESHOLD``), so most of a model lands in the heap, and freeing it leaves the
    pages with the process. The preload daemon drops its loaded model after packing it into the export segment;
    without this its resident memory stayed at about twice the segment's size beside it (CHANGELOG.md)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the symbols the process has loaded: the C library's among them
    except Exception:  # noqa: BLE001 - no such symbol (musl), or no dlopen(NULL) on this platform
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int  # int malloc_trim(size_t pad)
    before = _rss_anon_bytes()
    trim(0)
    after = _rss_anon_bytes()
    if before is None or after is None:
        return None
    return max(before - after, 0)
