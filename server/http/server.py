"""HttpServer: uvicorn serving the HTTP front in the gRPC server's event loop and process.

Start binds the socket itself (so port 0 works and a taken port is a clear error) and runs
uvicorn as a task. Stop stops accepting, lets in-flight requests finish within the grace
period, then cancels the rest (cancelling aborts their sequences in the engine). Signals
stay with ``server.loraplex_server.serve``, which drains both fronts.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator

import uvicorn

from ..server_options import ServerOptions
from ..state import ServerState
from .fastapi_app import build_app


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # SIGTERM / SIGINT belong to loraplex's serve(), which drains both fronts


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for ``host:port`` (asyncio calls listen on it)."""
    bare = host.strip("[]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port} for HTTP: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for HTTP (is the port taken?): "
                      f"{e}") from e
    return sock


def _config(state: ServerState, options: ServerOptions) -> uvicorn.Config:
    tls: dict = {}
    if options.ssl_certfile is not None:
        tls = {"ssl_certfile": str(options.ssl_certfile),
               "ssl_keyfile": str(options.ssl_keyfile)}
    if options.ssl_ca_certs is not None:  # mutual TLS, as on the gRPC port
        tls.update(ssl_ca_certs=str(options.ssl_ca_certs), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return uvicorn.Config(build_app(state), lifespan="off", log_config=None,
                          access_log=False, timeout_graceful_shutdown=options.shutdown_grace_s,
                          **tls)


class HttpServer:
    def __init__(self, state: ServerState, options: ServerOptions):
        self.state = state
        self.options = options
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None
        self.port: int | None = None

    async def start(self) -> int:
        """Listen on ``--host``:``--http-port``; the bound port."""
        assert self.options.http_port is not None
        sock = listen_socket(self.options.host, self.options.http_port)
        self.port = sock.getsockname()[1]
        self._server = _Uvicorn(_config(self.state, self.options))
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # a start-up failure (bad TLS files, say)
                self._task.result()
                raise OSError(f"the HTTP server on port {self.port} did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, grace: float) -> None:
        """Stop accepting; in-flight requests get ``grace`` seconds, then are cancelled.
        Returns once every request task has ended (its sequence aborted if unfinished)."""
        if self._server is None or self._task is None:
            return
        # uvicorn's wait for connections to close times out at once with 0, even when none
        # is open; a tenth of a second lets idle keep-alive connections close first
        self._server.config.timeout_graceful_shutdown = max(grace, 0.1)
        self._server.should_exit = True
        await self._task
        await self._settle()

    async def _settle(self) -> None:
        # uvicorn cancels what outlives the grace period but does not wait for it
        tasks = list(self._server.server_state.tasks) if self._server is not None else []
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    def cancel_now(self) -> None:
        """Cancel in-flight requests now (a second SIGTERM); ``stop`` then returns."""
        if self._server is None:
            return
        self._server.should_exit = True
        for task in list(self._server.server_state.tasks):
            task.cancel()
