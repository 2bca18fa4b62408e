"""The ``ipc_cache`` load format: a preload daemon keeps post-processed weights resident; engines map them.

Four subpackages, by role; an arrow is "imports":

- :mod:`.daemon` (``vllm-fastload preload``): ``main`` (flags, rank processes, supervision), ``export`` (build,
  post-process, pack), ``server`` (per-rank socket server, limits, lock, peer check), ``health`` (``/health``,
  ``/metrics``).
- :mod:`.engine` (the engine's side): ``loader`` (``IpcCacheLoader``: config, fallback, report), ``mapping`` (the
  steps of a mapped load), ``reload`` (vLLM's in-place ``reload_weights``), ``accounting`` (mapped GPU memory as
  the engine's weights).
- :mod:`.memory` (what is shared and how): ``transport`` + ``backends`` (the device/transport interface and its
  picker) with the backends ``memfd`` (CPU memfd) and ``cuda_vmm`` (CUDA VMM); ``layout`` (where each tensor sits
  in a segment, checksum samples); ``state`` (what a model holds and how to put it back).
- :mod:`.wire` (the protocol, nothing mapped): ``messages`` (every wire message as a pydantic model),
  ``protocol`` (framing, fd passing), ``paths`` (socket directory and names), ``client`` (connect, hello, lease).

``daemon`` -> ``memory``, ``wire``; ``engine`` -> ``memory``, ``wire``; ``memory`` -> ``wire`` (segment metadata);
``wire`` imports none of the others.
"""
