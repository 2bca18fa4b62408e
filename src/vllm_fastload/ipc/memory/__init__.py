"""What the daemon shares and how: transports (memfd, CUDA VMM), segment layout, a model's state."""
