"""The ``ipc_cache`` protocol: wire messages, framing and fd passing, socket paths, the client. Maps nothing."""
