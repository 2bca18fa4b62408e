"""vllm-fastload: an out-of-tree vLLM model-loader plugin that makes vLLM start and restart fast.

vLLM finds it through the ``vllm.general_plugins`` entry point (:func:`vllm_fastload.plugin.register`),
which registers the load format ``runai_streamer`` (replacing vLLM's built-in one).
Importing this package does not import vLLM or torch.
"""

__version__ = "0.1.0"
