"""The plugin's logger, ``vllm.fastload``: a child of vLLM's ``vllm`` logger, so its records reach the handlers
vLLM configures (vLLM configures only its own namespace) and follow ``VLLM_LOGGING_LEVEL``."""

import logging

logger = logging.getLogger("vllm.fastload")
