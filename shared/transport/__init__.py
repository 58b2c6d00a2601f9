"""KV transports: NIXL (UCX), ucxx and TCP behind one NIXL-shaped protocol (see `base`)."""

from shared.transport.base import (
    Descriptor,
    InvalidDescriptorError,
    MemoryRegion,
    MemType,
    TransferFailedError,
    TransferHandle,
    TransferOp,
    TransferState,
    TransferTimeoutError,
    Transport,
    TransportError,
    TransportUnavailableError,
    UnknownRemoteError,
    wait_async,
)
from shared.transport.factory import TRANSPORT_KINDS, available_transports, make_transport, unavailable_reason
from shared.transport.memory import host_buffer

__all__ = [
    "TRANSPORT_KINDS",
    "Descriptor",
    "InvalidDescriptorError",
    "MemType",
    "MemoryRegion",
    "TransferFailedError",
    "TransferHandle",
    "TransferOp",
    "TransferState",
    "TransferTimeoutError",
    "Transport",
    "TransportError",
    "TransportUnavailableError",
    "UnknownRemoteError",
    "available_transports",
    "host_buffer",
    "make_transport",
    "unavailable_reason",
    "wait_async",
]
