"""ServerOptions: everything about serving that is not the engine, frozen, validated once;
the fields that are ``loraplex serve`` flags declare them (loraplex.flag)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..flag import flag

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_MAX_QUEUE = 1024
DEFAULT_GRACE_S = 20.0
DEFAULT_MAX_UPLOAD_BYTES = 1 << 30
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # gRPC's own default message limit, set explicitly
MIN_REQUEST_BYTES = 2 << 20  # UploadAdapter's client sends 1 MiB chunks (client/upload_messages.py)
DEFAULT_MAX_CONCURRENT_UPLOADS = 2
DEFAULT_UPLOAD_IDLE_TIMEOUT_S = 30.0
DEFAULT_UPLOAD_TIMEOUT_S = 600.0
NETWORK = "network and security"
ADAPTERS = "adapters (training loops)"
TOOLS = "tool calls"
TOOL_CALL_PARSERS = ("hermes",)  # server/http/tool_calls.py reads each


@dataclass(frozen=True)
class ServerOptions:
    host: str = flag(DEFAULT_HOST, group=NETWORK, help="address of the gRPC and HTTP fronts")
    port: int = flag(DEFAULT_PORT, group=NETWORK,  # 0: pick a free port (tests)
                     help="gRPC port")
    http_port: int | None = flag(  # None: off, 0: any free port
        None, group=NETWORK, metavar="PORT",
        help="also serve vLLM's OpenAI-compatible HTTP API and /metrics on PORT (same "
        "process, engine, tokens and TLS; off unless given)")
    max_queue: int = flag(  # requests in flight (waiting + running)
        DEFAULT_MAX_QUEUE, group="capacity",
        help="requests in flight (waiting + running); RESOURCE_EXHAUSTED beyond")
    # server/auth.py's one rule: with any token set, every route but health, reflection and
    # /metrics needs one; admin routes the admin token when set, else this one
    api_token: str | None = flag(
        None, group=NETWORK, env="LORAPLEX_API_TOKEN",
        help="require a bearer token on every route but health, reflection and /metrics "
        "(also on the admin routes when --admin-token is not set) (env LORAPLEX_API_TOKEN)")
    admin_token: str | None = flag(  # accepted on every route too
        None, group=NETWORK, env="LORAPLEX_ADMIN_TOKEN",
        help="require it on the admin routes (AdapterAdmin, load/unload_lora_adapter, "
        "reset_prefix_cache); accepted on every other route, which needs a token once any is "
        "set (env LORAPLEX_ADMIN_TOKEN)")
    adapter_roots: tuple[Path, ...] = flag(  # LoadAdapter paths must be inside; resolved
        (), group=NETWORK, name="adapter-root", metavar="DIR",
        help="LoadAdapter / load_lora_adapter paths, and every file in them, must lie under "
        "one of these (repeatable)")
    allow_any_adapter_path: bool = flag(  # without --adapter-root, beyond loopback
        False, group=NETWORK,
        help="with no --adapter-root, let a server that listens beyond loopback load "
        "adapters at runtime from any path it can read (else such loads are refused)")
    # flag() makes a dataclasses.field, which ruff's RUF009 does not know
    ssl_certfile: Path | None = flag(  # noqa: RUF009
        None, group=NETWORK, help="server certificate (TLS on)")
    ssl_keyfile: Path | None = flag(None, group=NETWORK,  # noqa: RUF009
                                    help="its private key")
    ssl_ca_certs: Path | None = flag(  # noqa: RUF009  (set: clients need a cert it signed)
        None, group=NETWORK, help="require client certs it signed (mTLS)")
    shutdown_grace_s: float = flag(  # in-flight calls may finish within this
        DEFAULT_GRACE_S, group=NETWORK, name="shutdown-grace-period", metavar="SECONDS",
        help="on SIGTERM, in-flight requests may finish within")
    max_request_bytes: int = flag(  # one gRPC message, one HTTP body: refused before parsing
        DEFAULT_MAX_REQUEST_BYTES, group=NETWORK, kind="bytes", metavar="BYTES",
        help="the largest request: one gRPC message (RESOURCE_EXHAUSTED beyond) or one HTTP "
        "body (413 beyond), e.g. 16MiB; at least 2MiB")
    max_upload_bytes: int = flag(  # UploadAdapter's weights, in bytes
        DEFAULT_MAX_UPLOAD_BYTES, group=ADAPTERS, kind="bytes", metavar="BYTES",
        help="the largest adapter_model.safetensors UploadAdapter accepts (e.g. 256MiB)")
    max_concurrent_uploads: int = flag(  # UploadAdapter streams at once (per replica on Ray)
        DEFAULT_MAX_CONCURRENT_UPLOADS, group=ADAPTERS, metavar="N",
        help="UploadAdapter streams in flight at once; RESOURCE_EXHAUSTED beyond")
    upload_idle_timeout_s: float = flag(  # the longest wait for an upload's next message
        DEFAULT_UPLOAD_IDLE_TIMEOUT_S, group=ADAPTERS, name="upload-idle-timeout",
        metavar="SECONDS",
        help="an upload that sends no message for this long is dropped (DEADLINE_EXCEEDED) "
        "and its files removed")
    upload_timeout_s: float = flag(  # from an upload's first message to its last
        DEFAULT_UPLOAD_TIMEOUT_S, group=ADAPTERS, name="upload-timeout", metavar="SECONDS",
        help="an upload still sending this long after its first message is dropped "
        "(DEADLINE_EXCEEDED) and its files removed")
    upload_disk_budget: int | None = flag(  # None: max_concurrent_uploads x max_upload_bytes
        None, group=ADAPTERS, kind="bytes", metavar="BYTES",
        help="the weights' bytes all uploads in flight may hold on disk together (declared "
        "sizes reserved before a byte is written); RESOURCE_EXHAUSTED beyond (default: "
        "--max-concurrent-uploads x --max-upload-bytes)")
    upload_dir: Path | None = flag(  # noqa: RUF009  (None: a private temporary directory)
        None, group=ADAPTERS, metavar="DIR",
        help="where uploaded adapters are written; with --ray, storage every node reads at "
        "the same path (uploads are refused without it)")
    lora_resolver_dir: Path | None = flag(  # noqa: RUF009  (vLLM's filesystem resolver)
        None, group=ADAPTERS, metavar="DIR",
        help="a request naming an unregistered adapter X loads DIR/X (confined to DIR) on "
        "first use")
    lora_resolver_hf_cache: Path | None = flag(  # noqa: RUF009  (offline: never downloads)
        None, group=ADAPTERS, metavar="DIR",
        help="a request naming an unregistered adapter ORG/NAME loads that Hugging Face "
        "repo from this local Hub cache (e.g. ~/.cache/huggingface/hub), offline")
    enable_auto_tool_choice: bool = flag(  # vLLM's flag: tool_choice "auto" is a 400 without
        False, group=TOOLS,
        help='let chat tool_choice "auto" (the default with tools) read the model\'s own tool '
        "calls with --tool-call-parser")
    tool_call_parser: str | None = flag(
        None, group=TOOLS, choices=TOOL_CALL_PARSERS, metavar="NAME",
        help="the model's tool-call format for --enable-auto-tool-choice: hermes "
        "(<tool_call>{json}</tool_call>, Qwen 2.5/3 and Hermes)")
    warmup: bool = True  # one tiny generate before SERVING

    @property
    def auto_tool_parser(self) -> str | None:
        """The parser of tool_choice "auto"; None: auto is refused."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port={self.http_port} must be in [0, 65535]")
        if self.max_queue < 1:
            raise ValueError(f"max_queue={self.max_queue} must be >= 1")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser "
                             f"{'|'.join(TOOL_CALL_PARSERS)})")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r}; known: "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.max_request_bytes < MIN_REQUEST_BYTES:
            raise ValueError(f"max_request_bytes={self.max_request_bytes} must be >= "
                             f"{MIN_REQUEST_BYTES} (2 MiB: UploadAdapter's chunks are 1 MiB)")
        self._check_uploads()
        for name in ("upload_dir", "lora_resolver_dir", "lora_resolver_hf_cache"):
            path = getattr(self, name)
            if path is not None:
                object.__setattr__(self, name, Path(path).expanduser().resolve())
        if self.upload_dir is not None and self.upload_dir.exists() and \
                not self.upload_dir.is_dir():  # a missing one is made on the first upload
            raise ValueError(f"upload_dir={self.upload_dir} is not a directory")
        if self.lora_resolver_dir is not None and not self.lora_resolver_dir.is_dir():
            raise ValueError(f"lora_resolver_dir={self.lora_resolver_dir} is not a directory")
        if self.lora_resolver_hf_cache is not None and not self.lora_resolver_hf_cache.is_dir():
            raise ValueError(f"lora_resolver_hf_cache={self.lora_resolver_hf_cache} is not a "
                             "directory")
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
        # the one normalisation: roots as absolute paths, symlinks resolved
        roots = tuple(Path(r).expanduser().resolve() for r in self.adapter_roots)
        object.__setattr__(self, "adapter_roots", roots)
        for root in self.adapter_roots:
            if not root.is_dir():
                raise ValueError(f"adapter root {root} is not a directory")

    def _check_uploads(self) -> None:
        if self.max_upload_bytes < 1:
            raise ValueError(f"max_upload_bytes={self.max_upload_bytes} must be >= 1")
        if self.max_concurrent_uploads < 1:
            raise ValueError(f"max_concurrent_uploads={self.max_concurrent_uploads} must be "
                             ">= 1")
        for name in ("upload_idle_timeout_s", "upload_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name}={getattr(self, name)} must be a number of seconds "
                                 "> 0")
        if self.upload_disk_budget is not None and \
                self.upload_disk_budget < self.max_upload_bytes:
            raise ValueError(f"upload_disk_budget={self.upload_disk_budget} must be >= "
                             f"max_upload_bytes ({self.max_upload_bytes}), or one upload of "
                             "the largest size could never fit")

    @property
    def upload_budget(self) -> int:
        """The bytes of weights all uploads in flight may hold on disk together."""
        if self.upload_disk_budget is not None:
            return self.upload_disk_budget
        return self.max_concurrent_uploads * self.max_upload_bytes

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"
