"""Which :class:`.transport.Transport` serves a device: the one place that looks at device types."""

from __future__ import annotations

import torch

from .transport import NoTransport, Transport


def get_transport(device: torch.device) -> Transport:
    """The transport of ``device``: CPU -> ``memfd`` (:mod:`.memfd`), CUDA -> ``cuda_vmm`` (:mod:`.cuda_vmm`).

    Raises :class:`.transport.NoTransport` naming the device type for every other device, ROCm included (HIP has
    the same VMM API, but :mod:`.cuda_vmm` binds ``libcuda``)."""
    if device.type == "cpu":
        from .memfd import MemfdTransport

        return MemfdTransport()
    if device.type == "cuda":
        if torch.version.hip is not None:
            raise NoTransport("ipc_cache on ROCm is not supported yet (the CUDA VMM transport is bound to libcuda); "
                              "loading from disk")
        from .cuda_vmm import CudaVmmTransport

        return CudaVmmTransport()
    raise NoTransport(f"ipc_cache has no transport for {device.type} devices (CPU and CUDA only)")

