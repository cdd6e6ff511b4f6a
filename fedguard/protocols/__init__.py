"""The federated protocols a run can follow (``train.protocol``), one registered component each.

A protocol owns what a client does in a round and what that makes of the upload: its local step, the kind
of upload (``gradient`` or ``weights``), the fields its uploads declare, whether an upload is one batch (what
the server checks of the declared sizes) and the strategy ``server.strategy = 'auto'`` stands for. Nothing
outside this package compares a protocol's name to a string. A protocol of your own::

    from fedguard.protocols import Protocol, register_protocol

    @register_protocol("fedsgd-k")
    class KStepFedSGD(Protocol):
        ...

and ``server.plugins = "my_module"``, ``train.protocol = "fedsgd-k"``.
"""

from fedguard.protocols.base import LocalUpdate, Protocol, Schedule, UploadKind
from fedguard.protocols.local import FedAvg, FedSGD
from fedguard.protocols.registry import PROTOCOLS, protocol, register_protocol

__all__ = [
    "PROTOCOLS",
    "FedAvg",
    "FedSGD",
    "LocalUpdate",
    "Protocol",
    "Schedule",
    "UploadKind",
    "protocol",
    "register_protocol",
]
