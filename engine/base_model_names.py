"""The base model's names: the one rule for which model names run the base model (engine
and servers), and what a NOT_FOUND for an unknown name says is valid instead."""

from __future__ import annotations

from collections.abc import Sequence as Seq


def names_base_model(name: str | None, served_model_name: str | None, model_name: str) -> bool:
    """The one rule for the base model's names (engine and servers): empty or None, the
    served model name, or ``model_name`` (``LLMEngine.model_name``)."""
    return not name or name in (served_model_name, model_name)


def base_model_hint(base_names: Seq[str], loaded: int) -> str:
    """What a NOT_FOUND for a model name says is valid instead (every front, the resolver's
    too): the base model's names, and where the loaded adapters are listed (not the list:
    there may be thousands). A name that is a filesystem path (``--model /srv/x`` with no
    ``--served-model-name``) is not shown: an error never shows a server path."""
    shown = [n for n in base_names if not _is_path(n)]
    bases = " or ".join(repr(n) for n in shown) if shown else \
        "named first by GET /v1/models"
    return (f"the base model is {bases} (or an empty name), and the {loaded} loaded adapters "
            "are listed by GET /v1/models or gRPC ListAdapters")


def _is_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or "\\" in name
