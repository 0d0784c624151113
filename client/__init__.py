"""loraplex.client: the gRPC client package (uses proto/ only).

    grpc_client.py       Client, AsyncClient, the ``python -m loraplex.client health`` probe
    connection.py        ServerConnection: the one client config (address, tokens, TLS,
                         timeout), the fields of the Python clients and the CLI's flags
    request_messages.py  GenerateRequest / SamplingParams messages from Python values
    upload_messages.py   UploadAdapter's messages: a PEFT dir or model as header + chunks

The names are imported lazily, so that the config tree (config.py) can import
``ServerConnection`` without loading grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncClient": ".grpc_client",
    "Client": ".grpc_client",
    "ChannelOptions": ".grpc_client",
    "DEFAULT_TARGET": ".grpc_client",
    "MULTIPLEXED_MODEL_ID": ".grpc_client",
    "main": ".grpc_client",
    "ServerConnection": ".connection",
    "generate_request": ".request_messages",
    "sampling_params": ".request_messages",
    "structured_outputs_message": ".request_messages",
    "AdapterDirError": ".upload_messages",
    "adapter_files": ".upload_messages",
    "upload_messages": ".upload_messages",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .connection import ServerConnection as ServerConnection
    from .grpc_client import DEFAULT_TARGET as DEFAULT_TARGET
    from .grpc_client import MULTIPLEXED_MODEL_ID as MULTIPLEXED_MODEL_ID
    from .grpc_client import AsyncClient as AsyncClient
    from .grpc_client import ChannelOptions as ChannelOptions
    from .grpc_client import Client as Client
    from .grpc_client import main as main
    from .request_messages import generate_request as generate_request
    from .request_messages import sampling_params as sampling_params
    from .request_messages import structured_outputs_message as structured_outputs_message
    from .upload_messages import AdapterDirError as AdapterDirError
    from .upload_messages import adapter_files as adapter_files
    from .upload_messages import upload_messages as upload_messages


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
