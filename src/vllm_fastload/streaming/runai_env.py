"""runai-model-streamer's environment: every ``RUNAI_STREAMER_*`` variable this plugin sets is assembled here.

runai takes its settings from environment variables, read when a stream starts. Two sets are made, each applied
with :func:`~vllm_fastload.storage.scoped_environ` (restored afterwards, so nothing outlives the load):

* :func:`load_env`, the load's settings: the extra-config keys (:func:`config_env`), the object-storage endpoint
  (:func:`~vllm_fastload.storage.endpoint_env`) and the local read strategy (:func:`fs_strategy_env`). The loader
  applies them for the whole stream. The local read strategy may also be one of this package's own page-cache
  readers (:data:`URING_STRATEGY`, :mod:`.uring`; :data:`PREAD_STRATEGY`, :mod:`.preader`), which take no
  environment: :func:`fs_strategy_env` then returns a :class:`LocalReader`.
* :func:`ring_env`, the direct path's read ring: its depth and pads must match the pinned arena sized from the
  same ``pinned_slots`` (:func:`.direct.arena_bytes`), so :func:`.direct.stream_tensors` applies them itself,
  around the call that builds the ring (the only moment runai reads them), whoever calls it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

from ..errors import ConfigError
from ..log import logger
from ..storage import endpoint_env, is_object_uri, page_cache_fraction

#: runai filesystem strategy used when the checkpoint is in the page cache: plain buffered reads by a thread pool
#: (``O_DIRECT`` would read again from the device what is already in memory; docs/benchmarks.md compares them).
BUFFERED_STRATEGY = "sync_buffered"
#: ``fs_strategy`` of this package's thread-pool reader (:mod:`.preader`: ``os.preadv`` threads into a small pinned
#: ring), what ``auto`` reads with on the direct GPU path where io_uring is not available.
PREAD_STRATEGY = "pread_buffered"
#: ``fs_strategy`` of this package's io_uring reader (:mod:`.uring`: the consumer's thread keeps reads in flight,
#: the kernel's io-wq workers copy the page cache into the pinned ring), what ``auto`` picks for a warm page cache
#: on the direct GPU path; :data:`PREAD_STRATEGY` where io_uring is not available.
URING_STRATEGY = "uring_buffered"
#: The strategies this package reads with itself (local files, direct GPU path); the others are runai's.
OWN_STRATEGIES = (PREAD_STRATEGY, URING_STRATEGY)
#: Pads per runai ring buffer (``RUNAI_STREAMER_MAX_PADS_PER_BUFFER``, default 1024 = 4 MiB per buffer): one is
#: spent per file boundary inside a buffer (safetensors data sections have no holes), so a few suffice.
MAX_PADS = 16


class LocalReader(NamedTuple):
    """This package's page-cache reader for one load: ``threads`` (reader threads of :mod:`.preader`, or reads in
    flight = io-wq workers busy for :mod:`.uring`) and ``uring`` (True: :mod:`.uring`)."""

    threads: int
    uring: bool = False


def config_env(config: Any) -> dict[str, str]:
    """The variables a :class:`~vllm_fastload.config.StreamerConfig` sets (name -> value): ``concurrency``,
    ``memory_limit`` (bytes) and ``chunk_bytesize`` (bytes), each only when set."""
    env: dict[str, str] = {}
    if config.concurrency is not None:
        env["RUNAI_STREAMER_CONCURRENCY"] = str(config.concurrency)
    if config.memory_limit is not None:
        env["RUNAI_STREAMER_MEMORY_LIMIT"] = str(config.memory_limit)
    if config.chunk_bytesize is not None:
        env["RUNAI_STREAMER_CHUNK_BYTESIZE"] = str(config.chunk_bytesize)
    return env


def load_env(config: Any, files: Sequence[str], report: Any,
             direct: bool = False) -> tuple[dict[str, str], Optional[LocalReader]]:
    """``(env, reader)``: everything one load sets for runai (name -> value): :func:`config_env`, then the
    object-storage endpoint, then :func:`fs_strategy_env` for ``files`` (the shards; ``report`` gets the strategy's
    facts; ``direct``: the load takes the direct pinned path), and this package's reader (None: runai reads).
    Raises :class:`~vllm_fastload.errors.StorageError` when the S3 endpoints disagree."""
    fs_env, reader = fs_strategy_env(config, files, report, direct)
    return {**config_env(config), **endpoint_env(), **fs_env}, reader


def ring_env(pinned_slots: int) -> dict[str, str]:
    """runai's ring for the direct path: ``pinned_slots`` buffers with :data:`MAX_PADS` pads each."""
    return {"RUNAI_STREAMER_RING_BUFFERS": str(pinned_slots), "RUNAI_STREAMER_MAX_PADS_PER_BUFFER": str(MAX_PADS)}


def _ranks_on_this_host() -> int:
    """Ranks of this engine on this host: vLLM's world size over its node count
    (``vllm.distributed.parallel_state``); 1 when the distributed state is not set up (a load outside an engine)."""
    try:
        from vllm.distributed.parallel_state import get_node_count, get_world_group

        return max(1, get_world_group().world_size // max(1, get_node_count()))
    except (ImportError, AssertionError, AttributeError):
        return 1


def fs_strategy_env(config: Any, files: Sequence[str], report: Any,
                    direct: bool = False) -> tuple[dict[str, str], Optional[LocalReader]]:
    """``(env update, reader)`` from ``fs_strategy`` (see config). ``auto``: when >= 90% of the pages of ``files``
    are in the page cache (O_DIRECT would re-read them from the device), :data:`URING_STRATEGY` on the direct path
    (``direct``; measured faster than :data:`PREAD_STRATEGY` in every same-call comparison, docs/benchmarks.md) and
    runai's buffered reads otherwise; else runai's default. A ``RUNAI_STREAMER_FS_STRATEGY`` the
    user put in the environment wins over ``auto``. This package's strategies (:data:`OWN_STRATEGIES`) outside the
    direct path (CPU, ``pinned_reader`` false) read with runai's buffered reads instead, and
    :data:`URING_STRATEGY` where io_uring is not available (:func:`.uring.unavailable`) with
    :data:`PREAD_STRATEGY`, each logged at INFO. ``report.extra`` gets ``fs_strategy``, with ``auto``
    ``page_cache_fraction`` (0..1 or None) and, when chosen here, the reader count (``concurrency``). Threads:
    ``concurrency`` if set, else :func:`.preader.default_threads` for this host's ranks (:data:`PREAD_STRATEGY`) or
    ``pinned_slots`` reads in flight (:data:`URING_STRATEGY`). Raises
    :class:`~vllm_fastload.errors.ConfigError` for one of this package's strategies on object storage."""
    fs_strategy = config.fs_strategy
    if fs_strategy in OWN_STRATEGIES and any(is_object_uri(f) for f in files):
        raise ConfigError(f"--model-loader-extra-config: fs_strategy {fs_strategy!r} reads local files, but "
                          f"{files[0]} is in object storage: use 'auto' (or 'runai') for object storage")
    if fs_strategy == "auto":
        frac = page_cache_fraction(list(files))
        report.extra["page_cache_fraction"] = None if frac is None else round(frac, 3)
        if "RUNAI_STREAMER_FS_STRATEGY" in os.environ or frac is None or frac < 0.9:
            fs_strategy = "runai"
        else:
            fs_strategy = URING_STRATEGY if direct else BUFFERED_STRATEGY
    elif fs_strategy in OWN_STRATEGIES and not direct:
        logger.info("fastload: fs_strategy %s reads on the direct GPU path only (a GPU load with pinned_reader); "
                    "this load reads with runai's %s", fs_strategy, BUFFERED_STRATEGY)
        fs_strategy = BUFFERED_STRATEGY
    if fs_strategy == URING_STRATEGY:
        from .uring import unavailable

        why = unavailable()
        if why is not None:
            logger.info("fastload: fs_strategy %s: %s; this load reads with %s (os.preadv threads)", URING_STRATEGY,
                        why, PREAD_STRATEGY)
            fs_strategy = PREAD_STRATEGY
    if fs_strategy in OWN_STRATEGIES:
        from .preader import default_threads

        if fs_strategy == URING_STRATEGY:
            # reads in flight, not threads: io-wq's kernel workers copy, and the reads were what the loading thread
            # waited for (docs/benchmarks.md), so every slot may be read into at once
            threads = config.concurrency or config.pinned_slots
        else:
            threads = config.concurrency or default_threads(_ranks_on_this_host())
        report.extra.update(fs_strategy=fs_strategy, concurrency=threads)
        return {}, LocalReader(threads, fs_strategy == URING_STRATEGY)
    env = {} if fs_strategy == "runai" else {"RUNAI_STREAMER_FS_STRATEGY": fs_strategy}
    if (config.fs_strategy == "auto" and fs_strategy != "runai" and config.concurrency is None
            and "RUNAI_STREAMER_CONCURRENCY" not in os.environ):
        # Reading from the page cache is CPU work: one reader per CPU, up to 32, so that runai's default of 16 does
        # not oversubscribe a small machine; shared among the ranks of this host, which all read the whole
        # checkpoint at TP > 1 and would otherwise run ranks x readers threads on the same CPUs.
        env["RUNAI_STREAMER_CONCURRENCY"] = str(max(1, min(32, (os.cpu_count() or 16) // _ranks_on_this_host())))
        report.extra["concurrency"] = int(env["RUNAI_STREAMER_CONCURRENCY"])
    report.extra["fs_strategy"] = env.get("RUNAI_STREAMER_FS_STRATEGY",
                                          os.environ.get("RUNAI_STREAMER_FS_STRATEGY", "runai default"))
    return env, None
