"""Flag: the command-line form of one config field, kept on the field as dataclass metadata.

The config tree (engine/engine_config.py's EngineConfig, server/server_options.py's
ServerOptions, server/ray/ray_options.py's RayOptions, client/connection.py's
ServerConnection, config.py's ServeConfig and GenerateConfig) declares every flag where its
field is: name, default
(the field's), help, group, choices. config_flags.py (the only place that imports argparse
besides cli.py) derives the parsers from it, as vLLM's ``EngineArgs.add_cli_args`` and
mini-sglang's ``ServerArgs`` do. A field without a Flag is not a flag (a knob for tests and
the Python API). Imports nothing from loraplex: every layer may declare flags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

FLAG_KEY = "loraplex.flag"


@dataclass(frozen=True)
class Flag:
    """How one field reads from the command line. The flag is ``--field-name`` (vLLM's
    names) unless ``name`` says otherwise; its type follows the field's annotation unless
    ``kind`` names a text form the annotation does not say (config_flags.KINDS)."""

    help: str
    group: str
    choices: tuple[str, ...] | None = None
    kind: str | None = None  # "bytes", "max_loras", "lora_module", "path": config_flags.KINDS
    metavar: str | None = None
    env: str | None = None  # the default comes from this environment variable when set
    name: str | None = None  # without the leading "--"; default: the field name, dashed

    @property
    def option(self) -> str:
        return f"--{self.name}"


def flag(default: Any = MISSING, *, help: str, group: str,
         default_factory: Callable[[], Any] | Any = MISSING, **how: Any) -> Any:
    """A dataclass field that is also a flag (``how``: Flag's other fields)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={FLAG_KEY: Flag(help, group, **how)})


def flag_of(field: dataclasses.Field) -> Flag | None:
    """The field's Flag, named (``--field-name`` unless it says otherwise); None: no flag."""
    spec: Flag | None = field.metadata.get(FLAG_KEY)
    if spec is None or spec.name is not None:
        return spec
    return dataclasses.replace(spec, name=field.name.replace("_", "-"))
