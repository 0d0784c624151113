"""ServerOptions: everything about serving that is not the engine, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_MAX_QUEUE = 1024
DEFAULT_GRACE_S = 20.0


@dataclass
class ServerOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0: pick a free port (tests)
    http_port: int | None = None  # the OpenAI-compatible HTTP front; None: off, 0: any free
    max_queue: int = DEFAULT_MAX_QUEUE  # requests in flight (waiting + running)
    api_token: str | None = None  # guards Inference and ServerInfo when set
    admin_token: str | None = None  # guards AdapterAdmin when set (also accepted for the rest)
    adapter_roots: list[Path] = field(default_factory=list)  # LoadAdapter paths must be inside
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_ca_certs: Path | None = None  # set: clients must present a cert signed by it (mTLS)
    shutdown_grace_s: float = DEFAULT_GRACE_S  # in-flight calls may finish within this
    served_model_name: str | None = None  # alias of the base model besides ""
    warmup: bool = True  # one tiny generate before SERVING

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port={self.http_port} must be in [0, 65535]")
        if self.max_queue < 1:
            raise ValueError(f"max_queue={self.max_queue} must be >= 1")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s={self.shutdown_grace_s} must be >= 0")
        for name in ("api_token", "admin_token"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} is empty: give a non-empty token or leave it unset")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("ssl_certfile and ssl_keyfile must be given together")
        if self.ssl_ca_certs is not None and self.ssl_certfile is None:
            raise ValueError("ssl_ca_certs (mutual TLS) needs ssl_certfile and ssl_keyfile too")
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}={path} is not a readable file")
        self.adapter_roots = [Path(r).expanduser().resolve() for r in self.adapter_roots]
        for root in self.adapter_roots:
            if not root.is_dir():
                raise ValueError(f"adapter root {root} is not a directory")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"
