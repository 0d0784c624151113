"""The config tree's flags (config.py): parsers derived from its fields, objects built from
parsed flags. With cli.py and the commands' own modules, the only code that imports argparse.

``add_flags(parser, ServeConfig)`` adds one option per field that carries a Flag
(loraplex.flag), walking the sections: the option is the Flag's name, its dest the field's
name, its default the field's (or the Flag's environment variable), its type the field's
annotation (or the Flag's ``kind``), its group the Flag's. ``from_args(ServeConfig, args)``
builds the tree back from what was parsed. Nothing maps a flag to a field by hand, so every
command that has a section has its flags with the same names, defaults and help (as vLLM's
``EngineArgs.add_cli_args`` derives them from its configs, and mini-sglang's ServerArgs).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Collection, Iterator
from dataclasses import MISSING
from pathlib import Path
from typing import Any, NamedTuple

from .flag import Flag, flag_of
from .server.lora_modules import lora_modules_dict, parse_lora_module

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}
Groups = dict[str, argparse._ArgumentGroup]


def byte_size(text: str) -> int:
    """``4294967296``, ``4GiB``, ``512MB`` -> bytes."""
    number = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with KB, MB, GB, KiB, MiB, GiB"
        ) from None
    return int(value)


def max_loras_arg(text: str) -> int | str:
    """``auto`` or a positive integer."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor a positive integer")
    return value


def lora_module(text: str) -> Any:
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class Kind(NamedTuple):
    """A text form the annotation does not say: how one value parses, and (for a flag given
    many values) how the list becomes the field's value."""

    parse: Callable[[str], Any]
    collect: Callable[[list[Any]], Any] | None = None


KINDS: dict[str, Kind] = {
    "bytes": Kind(byte_size),
    "max_loras": Kind(max_loras_arg),
    "lora_module": Kind(lora_module, lora_modules_dict),  # NAME=PATH ... -> {name: path}
    "path": Kind(Path),  # a field that also takes other forms in Python (PEM bytes, say)
}


# ---- the parser ----------------------------------------------------------------------------
def add_flags(parser: argparse.ArgumentParser, cls: type, groups: Groups | None = None,
              required: Collection[str] = (), only: Collection[str] | None = None) -> Groups:
    """Add the flags of ``cls`` and its sections to ``parser`` (``required``: field names
    this command cannot do without; ``only``: these fields' flags alone, for a tool that
    takes a few settings of the tree with the command's names, types and defaults).
    Returns the groups, for a caller adding its own."""
    groups = {} if groups is None else groups
    for f, spec, hint in _flags(cls):
        if only is not None and f.name not in only:
            continue
        group = groups.get(spec.group) or groups.setdefault(
            spec.group, parser.add_argument_group(spec.group))
        if any(a.dest == f.name for a in parser._actions):  # one dest, one field of the tree
            raise ValueError(f"{spec.option}: a flag with dest {f.name!r} exists already")
        group.add_argument(spec.option, dest=f.name, required=f.name in required,
                           **_argument(f, spec, hint))
    return groups


def _flags(cls: type) -> Iterator[tuple[dataclasses.Field, Flag, Any]]:
    """(field, its Flag, its annotation) of every flag of ``cls``, sections walked in order;
    a section field that has a Flag is the switch that turns the section on."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        spec, section = flag_of(f), _section(hints[f.name])
        if spec is not None:
            yield f, spec, hints[f.name]
        if section is not None:
            yield from _flags(section)


def _argument(f: dataclasses.Field, spec: Flag, hint: Any) -> dict[str, Any]:
    """add_argument's keywords for one field."""
    default = _default(f, spec)
    kw: dict[str, Any] = {"help": spec.help, "metavar": spec.metavar, "choices": spec.choices}
    value_type, many = _value_type(hint)
    kind = KINDS[spec.kind] if spec.kind is not None else None
    if value_type is bool or _section(hint) is not None:
        return {"help": spec.help, "action": "store_true"}
    if many:
        # "append" copies a list default and adds to the copy; a tuple would not take it
        kw.update(action="extend" if kind else "append", nargs="+" if kind else None,
                  default=list(default))
    else:
        kw["default"] = default
        if default is not None and spec.env is None:  # no secret from the environment
            kw["help"] += " (default: %(default)s)"
    kw["type"] = kind.parse if kind else value_type
    return kw


def _default(f: dataclasses.Field, spec: Flag) -> Any:
    if spec.env is not None and os.environ.get(spec.env) is not None:
        return os.environ[spec.env]
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


def _value_type(hint: Any) -> tuple[Any, bool]:
    """(the type one value parses to, whether the field holds many): ``int | None`` -> int;
    ``tuple[Path, ...]`` -> (Path, True); dicts hold many (their Flag's kind collects them)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else rest  # several: the Flag's kind parses it
    origin = typing.get_origin(hint)
    if origin in (list, tuple):
        return typing.get_args(hint)[0], True
    return hint, origin is dict


def _section(hint: Any) -> type | None:
    """The dataclass a field holds (``X`` or ``X | None``), or None for a plain value."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


# ---- the objects ---------------------------------------------------------------------------
def from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """``cls`` built from ``args`` (parsed by a parser that ``add_flags(parser, cls)`` made):
    each flag field takes its flag's value; each section is built the same way (a switched
    section only when its switch is on); ``given`` sets fields of that name in every section
    outright (values the command computed, e.g. ``lora_modules`` with the demo adapters).
    The constructors validate: ValueError names the field and what is allowed."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec, section = flag_of(f), _section(hints[f.name])
        if section is not None:
            if spec is None or getattr(args, f.name):
                values[f.name] = from_args(section, args, **given)
            else:
                _refuse_unswitched(section, args, spec)
        elif f.name in given:
            values[f.name] = given[f.name]
        elif spec is not None:
            values[f.name] = _field_value(f, spec, hints[f.name], getattr(args, f.name))
    return cls(**values)


def _field_value(f: dataclasses.Field, spec: Flag, hint: Any, value: Any) -> Any:
    kind = KINDS[spec.kind] if spec.kind is not None else None
    if kind is not None and kind.collect is not None:
        return kind.collect(value)
    return tuple(value) if typing.get_origin(hint) is tuple else value


def _refuse_unswitched(section: type, args: argparse.Namespace, switch: Flag) -> None:
    """A section that is off takes no flags: ValueError naming those given."""
    given = [spec.option for f, spec, _ in _flags(section)
             if getattr(args, f.name) != _default(f, spec)]
    if given:
        raise ValueError(f"{', '.join(given)} only apply with {switch.option}")


# ---- back to a command line ----------------------------------------------------------------
def to_argv(config: Any) -> list[str]:
    """The flags that parse back to ``config`` (a ServeConfig, say: ``serve``'s parser on
    ``to_argv(c)`` builds ``c`` again): one option per flag field whose value differs from
    its default (a switched section: its switch, then its fields). How a benchmark or a test
    starts ``loraplex serve`` from a config object, with the same defaults as the command.
    ValueError where no command line can say the value: a field without a flag that differs
    from its default (unless a flag of that name elsewhere in the tree sets it), None for a
    flag whose default is not None, a default list that a flag could only add to."""
    flagged = {f.name for f, _, _ in _flags(type(config))}
    argv: list[str] = []
    _to_argv(config, flagged, argv)
    return argv


def _to_argv(config: Any, flagged: set[str], argv: list[str]) -> None:
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, spec, section = getattr(config, f.name), flag_of(f), _section(hints[f.name])
        if section is not None:
            if value is not None:
                argv += [spec.option] if spec is not None else []
                _to_argv(value, flagged, argv)
        elif spec is not None:
            argv += _flag_argv(f, spec, hints[f.name], value)
        elif f.name not in flagged and value != _field_default(f):
            raise ValueError(f"{type(config).__name__}.{f.name}={value!r}: not a flag, no "
                             "command line sets it")


def _field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


def _flag_argv(f: dataclasses.Field, spec: Flag, hint: Any, value: Any) -> list[str]:
    """One field's part of the command line, as _argument's parser reads it back."""
    value_type, many = _value_type(hint)
    kind = KINDS[spec.kind] if spec.kind is not None else None
    if value_type is bool:  # store_true: the option is the value
        return [spec.option] if value else []
    default = _default(f, spec)
    if many:
        items = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else \
            [_text(v) for v in value]
        defaults = list(default)
        if items == [_text(v) for v in defaults] or (isinstance(value, dict) and
                                                     value == default):
            return []
        if defaults:  # append / extend add to a copy of the default
            raise ValueError(f"{spec.option}: a default of {defaults!r} can only grow")
        if kind is not None:  # extend, nargs "+"
            return [spec.option, *items] if items else []
        return [part for item in items for part in (spec.option, item)]  # append
    if value == default:
        return []
    if value is None:
        raise ValueError(f"{spec.option}: None is not a value a command line gives "
                         f"(its default is {default!r})")
    return [spec.option, _text(value)]


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)
