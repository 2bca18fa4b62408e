"""The engine side of ``ipc_cache``: the loader vLLM calls, the mapped load, in-place reload, accounting."""
