"""The ``runai_streamer`` load format: safetensors streamed by runai-model-streamer's thread pool."""
