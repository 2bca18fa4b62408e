"""vllm-fastload: an out-of-tree vLLM model-loader plugin that makes vLLM start and restart fast.

vLLM finds it through the ``vllm.general_plugins`` entry point (:func:`vllm_fastload.plugin.register`),
which registers two load formats, replacing vLLM's built-in ones of those names:

* ``runai_streamer``: streams safetensors (local, ``s3://``, ``gs://``, ``az://``) with runai-model-streamer's
  readers into pinned memory and overlaps the reads with host-to-device copies; at TP > 1 the ranks of a host
  split the reads and broadcast the tensors (:mod:`vllm_fastload.streaming`);
* ``ipc_cache``: maps weights a ``vllm-fastload preload`` daemon keeps resident, instead of reading disk
  (:mod:`vllm_fastload.ipc`).

Both are tuned through ``--model-loader-extra-config`` (:mod:`vllm_fastload.config`).
Importing this package does not import vLLM or torch.
"""

__version__ = "0.1.0"
