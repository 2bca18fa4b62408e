"""vLLM general-plugin entry point (``vllm.general_plugins`` -> ``vllm_fastload.plugin:register``).

vLLM calls every general plugin once per process (API server, engine core, each worker), so :func:`register` is
idempotent and cheap. It registers :class:`RunaiStreamerLoader` for the load format ``runai_streamer`` and
:class:`IpcCacheLoader` for ``ipc_cache`` with ``vllm.model_executor.model_loader.register_model_loader``, replacing
vLLM's built-in loaders of those names (vLLM logs that it overwrites it). ``VLLM_PLUGINS`` can exclude this plugin by
its name, ``vllm_fastload``.
"""

from __future__ import annotations


def register() -> None:
    """Register this plugin's load formats with vLLM (no-op when already registered in this process)."""
    from vllm.model_executor import model_loader as ml

    from .ipc.engine.loader import IpcCacheLoader
    from .streaming.loader import RunaiStreamerLoader

    registry = getattr(ml, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
    for name, cls in (("runai_streamer", RunaiStreamerLoader), ("ipc_cache", IpcCacheLoader)):
        if registry.get(name) is not cls:
            ml.register_model_loader(name)(cls)
