"""loraplex.client: sync and async gRPC clients for a loraplex server (uses proto/ only).

    with Client("127.0.0.1:50051") as c:
        print(c.generate("the capital of france is", max_new_tokens=8, temperature=0).text)
        for chunk in c.generate_stream("hello", adapter="sql"):
            print(chunk.text, end="", flush=True)

Every Inference call also sends the adapter name as ``multiplexed_model_id`` metadata, so
that Ray Serve (``loraplex serve --ray``) routes it to a replica already holding the adapter;
a single server ignores it. The sampling keywords (``n``, ``logprobs``,
``prompt_logprobs``, penalties, ``logit_bias``, ``min_p``, ...) are request_messages.py's.
With ``n`` > 1, ``generate`` returns every choice in ``.choices`` and each stream message
names the choice it extends (``.index``). Readiness probe: ``python -m loraplex.client
health --server HOST:PORT`` exits 0 only when the server reports SERVING. Tokens go out as
``authorization: Bearer <token>``: ``api_token`` on Inference and ServerInfo,
``admin_token`` on AdapterAdmin; each falls back to the other when it is not given (the
server's rule: the admin token is accepted everywhere, and with no ``--admin-token`` the API
token guards AdapterAdmin).

Where the client and ``loraplex generate`` differ (stated in the CLI's ``--help`` too):
``temperature`` left unset here is the model's default (its generation_config), where the
CLI sends 0 (greedy); ``apply_chat_template`` is off here (the prompt goes as is), where
the CLI applies the chat template unless ``--no-chat-template``; ``max_new_tokens`` unset
here runs up to max_model_len, where the CLI stops after 256. The connection
(ServerConnection: address, tokens, TLS, ``timeout``) is the same config with the same
defaults on both; the health probe alone waits 5 s by default.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..proto import loraplex_pb2 as pb
from ..proto import loraplex_pb2_grpc as pb_grpc
from .connection import ServerConnection
from .request_messages import generate_request, sampling_params  # noqa: F401  (re-exported)
from .upload_messages import upload_messages

if TYPE_CHECKING:
    from typing_extensions import Self

DEFAULT_TARGET = "127.0.0.1:50051"
HEALTH_TIMEOUT = 5.0  # seconds: the health probe's default deadline (a probe must end)
MULTIPLEXED_MODEL_ID = "multiplexed_model_id"
# Names that can be adapters (server/adapter_paths.py: 1 to 128 of these characters) and are
# valid header values; any other name goes without the metadata, and the server refuses it.
_ROUTABLE_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
# the one client config; ChannelOptions is its former name, kept for callers
ChannelOptions = ServerConnection


class _Stubs:
    def __init__(self, channel: grpc.Channel | grpc.aio.Channel, options: ServerConnection):
        self.options = options
        self.inference = pb_grpc.InferenceStub(channel)
        self.admin = pb_grpc.AdapterAdminStub(channel)
        self.info = pb_grpc.ServerInfoStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    # the server's one rule (server/auth.py): API routes take the API or the admin token,
    # admin routes the admin token, or the API token when the server has no admin token
    def api(self, timeout: float | None) -> dict:
        o = self.options
        return {"metadata": o.metadata(o.api_token or o.admin_token),
                    "timeout": timeout if timeout is not None else self.options.timeout}

    def inference_kw(self, timeout: float | None, request: pb.GenerateRequest) -> dict:
        kw = self.api(timeout)
        if _ROUTABLE_NAME.fullmatch(request.adapter):  # Ray Serve's affinity routing key
            kw["metadata"] = (*kw["metadata"], (MULTIPLEXED_MODEL_ID, request.adapter))
        return kw

    def adm(self, timeout: float | None) -> dict:
        o = self.options
        return {"metadata": o.metadata(o.admin_token or o.api_token),
                    "timeout": timeout if timeout is not None else self.options.timeout}


def _health_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


class _Connection:
    """What both clients share: a channel to ServerConnection's target and its stubs; the
    channel's kind (blocking or grpc.aio) is the subclass's ``_grpc``."""

    _grpc: Any = grpc

    def __init__(self, target: str = DEFAULT_TARGET, **options: object):
        """``options``: ServerConnection's other fields (tokens, TLS, ``timeout``)."""
        self._connect(ServerConnection(target, **options))  # type: ignore[arg-type]

    @classmethod
    def from_config(cls, config: ServerConnection) -> Self:
        """A client on ``config`` (the CLI's: ValueError when it has no --server)."""
        client = cls.__new__(cls)
        client._connect(config)
        return client

    def _connect(self, o: ServerConnection) -> None:
        if o.target is None:
            raise ValueError("no server to connect to: give --server HOST:PORT")
        self.options = o
        self.channel = (self._grpc.secure_channel(o.target, o.credentials(), o.channel_args())
                        if o.secure else self._grpc.insecure_channel(o.target))
        self._s = _Stubs(self.channel, o)


class Client(_Connection):
    """Blocking client. Errors are ``grpc.RpcError`` with ``.code()`` and ``.details()``."""

    def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                 **kwargs: object) -> pb.GenerateResponse:
        return self.generate_with_trailers(prompt, timeout=timeout, **kwargs)[0]

    def generate_with_trailers(self, prompt: str | None = None, *,
                               timeout: float | None = None, **kwargs: object
                               ) -> tuple[pb.GenerateResponse, dict[str, str]]:
        """The reply and the call's trailing metadata (Ray Serve: ``loraplex-replica``)."""
        request = generate_request(prompt, **kwargs)
        reply, call = self._s.inference.Generate.with_call(
            request, **self._s.inference_kw(timeout, request))
        return reply, dict(call.trailing_metadata() or ())

    def generate_stream(self, prompt: str | None = None, *, timeout: float | None = None,
                        **kwargs: object) -> Iterator[pb.GenerateStreamResponse]:
        """The stream's messages; ``.cancel()`` on the returned call stops the request, and
        ``.trailing_metadata()`` after the end has the trailers."""
        request = generate_request(prompt, **kwargs)
        return self._s.inference.GenerateStream(request, **self._s.inference_kw(timeout, request))

    def load_adapter(self, name: str, path: str | Path, replace: bool = False,
                     pin: bool = False, timeout: float | None = None) -> pb.AdapterInfo:
        request = pb.LoadAdapterRequest(name=name, path=str(path), replace=replace, pin=pin)
        return self._s.admin.LoadAdapter(request, **self._s.adm(timeout))

    def upload_adapter(self, name: str, dir_or_peft_model: str | Path | Any,
                       replace: bool = False, pin: bool = False,
                       timeout: float | None = None) -> pb.AdapterInfo:
        """Send a PEFT dir (or a PEFT model) over the stream: no shared disk needed."""
        messages = upload_messages(name, dir_or_peft_model, replace, pin)
        return self._s.admin.UploadAdapter(messages, **self._s.adm(timeout))

    def reset_prefix_cache(self, timeout: float | None = None) -> None:
        self._s.admin.ResetPrefixCache(pb.ResetPrefixCacheRequest(), **self._s.adm(timeout))

    def unload_adapter(self, name: str, timeout: float | None = None
                       ) -> pb.UnloadAdapterResponse:
        return self._s.admin.UnloadAdapter(pb.UnloadAdapterRequest(name=name),
                                           **self._s.adm(timeout))

    def list_adapters(self, timeout: float | None = None) -> list[pb.AdapterInfo]:
        reply = self._s.admin.ListAdapters(pb.ListAdaptersRequest(), **self._s.adm(timeout))
        return list(reply.adapters)

    def server_info(self, timeout: float | None = None) -> pb.GetServerInfoResponse:
        return self._s.info.GetServerInfo(pb.GetServerInfoRequest(), **self._s.api(timeout))

    def stats(self, timeout: float | None = None) -> pb.GetStatsResponse:
        return self._s.info.GetStats(pb.GetStatsRequest(), **self._s.api(timeout))

    def health(self, service: str = "", timeout: float | None = HEALTH_TIMEOUT) -> str:
        """"SERVING", "NOT_SERVING", ... for ``service`` ("" = the whole server)."""
        reply = self._s.health.Check(health_pb2.HealthCheckRequest(service=service),
                                     timeout=timeout)
        return _health_name(reply.status)

    def wait_until_serving(self, timeout: float = 60.0) -> None:
        """Poll health until SERVING; TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=1.0) == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.options.target} not SERVING after {timeout}s")
            time.sleep(0.1)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Connection):
    """asyncio client (grpc.aio); the same methods as Client, awaited."""

    _grpc = grpc.aio

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None,
                       **kwargs: object) -> pb.GenerateResponse:
        request = generate_request(prompt, **kwargs)
        return await self._s.inference.Generate(request, **self._s.inference_kw(timeout, request))

    async def generate_stream(self, prompt: str | None = None, *, timeout: float | None = None,
                              **kwargs: object) -> AsyncIterator[pb.GenerateStreamResponse]:
        request = generate_request(prompt, **kwargs)
        call = self._s.inference.GenerateStream(request, **self._s.inference_kw(timeout, request))
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()  # no-op once finished; stops the request if the caller left early

    async def load_adapter(self, name: str, path: str | Path, replace: bool = False,
                           pin: bool = False, timeout: float | None = None) -> pb.AdapterInfo:
        request = pb.LoadAdapterRequest(name=name, path=str(path), replace=replace, pin=pin)
        return await self._s.admin.LoadAdapter(request, **self._s.adm(timeout))

    async def upload_adapter(self, name: str, dir_or_peft_model: str | Path | Any,
                             replace: bool = False, pin: bool = False,
                             timeout: float | None = None) -> pb.AdapterInfo:
        messages = list(upload_messages(name, dir_or_peft_model, replace, pin))
        return await self._s.admin.UploadAdapter(iter(messages), **self._s.adm(timeout))

    async def reset_prefix_cache(self, timeout: float | None = None) -> None:
        await self._s.admin.ResetPrefixCache(pb.ResetPrefixCacheRequest(),
                                             **self._s.adm(timeout))

    async def unload_adapter(self, name: str, timeout: float | None = None
                             ) -> pb.UnloadAdapterResponse:
        return await self._s.admin.UnloadAdapter(pb.UnloadAdapterRequest(name=name),
                                                 **self._s.adm(timeout))

    async def list_adapters(self, timeout: float | None = None) -> list[pb.AdapterInfo]:
        reply = await self._s.admin.ListAdapters(pb.ListAdaptersRequest(),
                                                 **self._s.adm(timeout))
        return list(reply.adapters)

    async def server_info(self, timeout: float | None = None) -> pb.GetServerInfoResponse:
        return await self._s.info.GetServerInfo(pb.GetServerInfoRequest(),
                                                **self._s.api(timeout))

    async def stats(self, timeout: float | None = None) -> pb.GetStatsResponse:
        return await self._s.info.GetStats(pb.GetStatsRequest(), **self._s.api(timeout))

    async def health(self, service: str = "", timeout: float | None = HEALTH_TIMEOUT) -> str:
        reply = await self._s.health.Check(health_pb2.HealthCheckRequest(service=service),
                                           timeout=timeout)
        return _health_name(reply.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m loraplex.client health``: exit 0 when SERVING (a readiness probe). Its
    flags are ServerConnection's, as on the client commands; two defaults differ, as the
    help says: --server is 127.0.0.1:50051 and --timeout 5 s (a probe must end)."""
    from ..config_flags import add_flags, from_args

    parser = argparse.ArgumentParser(prog="python -m loraplex.client")
    parser.add_argument("command", choices=["health"])
    add_flags(parser, ServerConnection)
    probe_defaults = {"target": DEFAULT_TARGET, "timeout": HEALTH_TIMEOUT}
    parser.set_defaults(**probe_defaults)
    for action in parser._actions:
        if action.dest in probe_defaults:
            action.help = f"{action.help.split(' (default')[0]} (default here: %(default)s)"
    config = from_args(ServerConnection, parser.parse_args(argv))
    with Client.from_config(config) as client:
        try:
            status = client.health(timeout=config.timeout)
        except grpc.RpcError as e:
            print(f"UNREACHABLE: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2
    print(status)
    return 0 if status == "SERVING" else 1
