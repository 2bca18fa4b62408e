"""The preload daemon (``vllm-fastload preload``): rank processes, export, socket server, health endpoint."""
