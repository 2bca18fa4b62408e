"""The ``ipc_cache`` load format: a preload daemon keeps post-processed weights resident; engines map them.

Modules: ``protocol`` (framed JSON over a Unix socket, file descriptors over SCM_RIGHTS, no pickle), ``paths``
(socket directory and names), ``shm`` (CPU transport: one memfd segment per rank), ``state`` (what a model holds
and how to put it back), ``daemon`` (``vllm-fastload preload``), ``client`` and ``loader`` (``IpcCacheLoader``).
"""
