"""The ``ipc_cache`` load format: a preload daemon keeps post-processed weights resident; engines map them.

Daemon (``vllm-fastload preload``): ``daemon`` (flags, rank processes, supervision), ``export`` (build,
post-process, pack), ``server`` (per-rank socket server, lock, peer check), ``health`` (``/health``, ``/metrics``).
Engine: ``loader`` (``IpcCacheLoader``: config, fallback, report), ``mapping`` (the steps of a mapped load),
``reload`` (vLLM's in-place ``reload_weights``: restore device, the zero_copy write guard, the checkpoint read),
``client`` (connect, hello, lease), ``accounting`` (mapped GPU memory as the engine's weights).
Both: ``messages`` (every wire message as a pydantic model), ``protocol`` (framing, fd passing), ``paths``
(socket directory and names), ``state`` (what a model holds and how to put it back), ``layout`` (where each
tensor sits in a segment, checksum samples), ``transport`` + ``backends`` (the device/transport interface and
its picker) with the backends ``shm`` (CPU memfd) and ``cuda_vmm`` (CUDA VMM).
"""
