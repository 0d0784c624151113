"""The config tree's root: one frozen dataclass per command, made of the sections it has.

    ServeConfig       serve [--ray]  engine: EngineConfig (engine/engine_config.py)
                                     server: ServerOptions (server/server_options.py)
                                     ray: RayOptions (server/ray/ray_options.py), None without
                                     --ray
    GenerateConfig    generate       engine: EngineConfig (in-process, without --server)
                                     connection: ServerConnection (client/connection.py)
    ServerConnection  adapters, bench, the health probe (and the Python clients' keywords)

Each setting is stored once: --served-model-name is the engine's (the server reads it there).

Every flag of these commands that is a setting is a field of the tree and declares itself
there (loraplex.flag); config_flags.py derives the parsers and builds these objects from the
parsed flags, so a flag has one name, default and help on every command. What is only known
once the model loads is engine/resolved_config.py's ResolvedConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .client.connection import ServerConnection
from .engine.engine_config import EngineConfig
from .flag import flag
from .server.ray.ray_options import RAY, RayOptions
from .server.server_options import ServerOptions


@dataclass(frozen=True)
class ServeConfig:
    """``loraplex serve``: the engine, the server around it, and Ray Serve with ``--ray``
    (``ray`` is then every replica's; ``engine`` is every replica's engine)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerOptions = field(default_factory=ServerOptions)
    ray: RayOptions | None = flag(  # noqa: RUF009
        None, group=RAY,
        help="serve engine replicas on Ray Serve behind its gRPC proxy on --port (which "
        "listens on every interface: --host applies to --http-port only; no TLS)")
    log_level: str = flag("INFO", group="logging", help="DEBUG, INFO, WARNING or ERROR")


@dataclass(frozen=True)
class GenerateConfig:
    """``loraplex generate``: through ``connection.server`` when it is set, else in-process
    on an engine built from ``engine``."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    connection: ServerConnection = field(default_factory=ServerConnection)
