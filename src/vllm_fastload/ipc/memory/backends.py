"""Which :class:`.transport.Transport` serves a device: the one place that looks at device types."""

from __future__ import annotations

import os

import torch

from ..wire.messages import SegmentMeta
from .transport import NoTransport, Segment, Transport


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


def open_segment(fd: int, meta: SegmentMeta, device: torch.device) -> Segment:
    """Map the received segment ``meta`` describes on ``device`` through the device's transport (closes ``fd``).
    Raises :class:`~vllm_fastload.errors.ManifestError` when the segment does not fit the device, and
    :class:`.transport.NoTransport` for a device without a transport (``fd`` closed as well)."""
    try:
        transport = get_transport(device)
    except NoTransport:
        os.close(fd)
        raise
    return transport.open(fd, meta, device)
