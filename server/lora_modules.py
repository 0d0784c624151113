"""``--lora-modules`` items: ``name=path`` or the JSON form
``{"name": ..., "path": ..., "base_model_name": ...}`` (vLLM's), checked before the model
loads so that a bad item is a usage error that names it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .adapter_paths import check_adapter_name

JSON_KEYS = ("name", "path", "base_model_name")
FORMS = 'name=path or {"name": ..., "path": ..., "base_model_name": ...}'


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: Path
    base_model_name: str | None = None  # informational (the base it was trained on)


def parse_lora_module(item: str) -> LoraModule:
    """One ``--lora-modules`` item; ValueError naming the item and the accepted forms."""
    text = item.strip()
    if text.startswith(("{", "[")):
        name, path, base = _parse_json(item, text)
    else:
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"item {item!r} is not {FORMS}")
        name, path, base = name.strip(), path.strip(), None
    try:
        check_adapter_name(name, None)
    except ValueError as e:
        raise ValueError(f"item {item!r}: {e}") from None
    return LoraModule(name, _adapter_dir(item, path), base)


def _parse_json(item: str, text: str) -> tuple[str, str, str | None]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"item {item!r} is not valid JSON ({e.msg} at "
                         f"character {e.pos}); expected {FORMS}") from None
    if not isinstance(obj, dict):  # a usage error like the others, hence ValueError
        raise ValueError(f"item {item!r} must be a JSON object: {FORMS}")  # noqa: TRY004
    unknown = sorted(set(obj) - set(JSON_KEYS))
    if unknown:
        raise ValueError(f"item {item!r} has unknown keys {unknown}; allowed: "
                         f"{list(JSON_KEYS)}")
    for key in ("name", "path"):
        if not isinstance(obj.get(key), str) or not obj[key].strip():
            raise ValueError(f"item {item!r} needs a non-empty string {key!r}")
    base = obj.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"item {item!r}: base_model_name must be a string")
    return obj["name"].strip(), obj["path"].strip(), base


def _adapter_dir(item: str, path: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        what = "does not exist" if not p.exists() else "is not a directory"
        raise ValueError(f"item {item!r}: {p} {what}; give a PEFT LoRA adapter "
                         "directory (adapter_config.json + adapter_model.safetensors)")
    if not (p / "adapter_config.json").is_file():
        raise ValueError(f"item {item!r}: {p} has no adapter_config.json; give a "
                         "PEFT LoRA adapter directory")
    return p.resolve()


def lora_modules_dict(modules: Iterable[LoraModule]) -> dict[str, str]:
    """name -> path for the engine; ValueError on a name given twice."""
    out: dict[str, str] = {}
    for m in modules:
        if m.name in out:
            raise ValueError(f"--lora-modules names adapter {m.name!r} twice ({out[m.name]} and "
                             f"{m.path}); names must be unique")
        out[m.name] = str(m.path)
    return out


def check_servable(modules: dict[str, str]) -> None:
    """Read each adapter_config.json as the engine will (PEFT's loader, the same refusals);
    ValueError naming the adapter. Weights and shapes are checked when the engine loads."""
    from ..lora.adapter_files import AdapterFiles
    from ..lora.peft_checks import check_servable as check_config
    from ..lora.peft_files import lora_config

    for name, path in modules.items():
        try:
            check_config(lora_config(AdapterFiles(Path(path)))[0], Path(path))
        except ValueError as e:
            raise ValueError(f"--lora-modules {name}={path}: {e}") from None


def demo_adapters(folder: Path) -> dict[str, str]:
    """The demo adapters shipped in ``folder`` (each a subfolder with adapter_config.json)."""
    if not folder.is_dir():
        return {}
    return {d.name: str(d) for d in sorted(folder.iterdir())
            if (d / "adapter_config.json").is_file()}
