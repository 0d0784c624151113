"""BaseShapes: the base model an adapter is checked against (its modules' shapes, layers,
vocabulary, tokenizer), and the rule for the base an adapter says it was trained on.

Base model rule: ``base_model_name_or_path`` refuses the adapter only when both sides can
be compared, i.e. it names a local directory (other than the served base) whose
``config.json`` loads and differs from the served base in model_type, hidden_size,
num_layers, vocab_size or a module shape; a config that loads but cannot be shaped (not
Llama-like, as GPT-2, or a model type transformers does not know) is compared by its
model_type alone. A bare name that differs, a path that does not exist here, or a config
that cannot be read (not JSON, no model_type, values its model type's config refuses) is
not an error: the tensor shapes are checked anyway.
An adapter confined to a root (``root``: one a server loaded for a client) never makes the
server open a path outside it: a ``base_model_name_or_path`` that does not resolve inside
the root is not followed (not compared).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .adapter_files import AdapterFiles, read_all, real_path
from .peft_checks import AdapterError
from .peft_files import PARSED, content_key

if TYPE_CHECKING:
    import transformers


@dataclass(frozen=True)
class BaseShapes:
    """What the base model accepts: (in, out) features per target module, layers, identity."""

    num_layers: int
    modules: dict[str, tuple[int, int]]  # "q_proj" -> (hidden, num_heads * head_dim), ...
    model_type: str
    name_or_path: str  # the base model dir or name, for base_model_name_or_path checks
    hidden_size: int
    vocab_size: int
    tied: bool = False  # the head is the embedding (tie_word_embeddings); not compared
    # the base's tokenizer, which an adapter's own must extend (adapter_vocab.py); not
    # compared
    tokenizer: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def from_hf_config(cls, config: transformers.PretrainedConfig, name_or_path: str) -> BaseShapes:
        """Shapes of a supported config; head_dim = config.head_dim or hidden // heads. Phi-3's
        modules are its fused qkv_proj and gate_up_proj (with o_proj, down_proj)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        inter = config.intermediate_size
        modules = {
            "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
        }
        if config.model_type == "phi3":
            modules = {"qkv_proj": (hidden, (heads + 2 * kv_heads) * head_dim),
                       "o_proj": modules["o_proj"], "gate_up_proj": (hidden, 2 * inter),
                       "down_proj": modules["down_proj"]}
        return cls(num_layers=config.num_hidden_layers, modules=modules,
                   model_type=config.model_type, name_or_path=str(name_or_path),
                   hidden_size=hidden, vocab_size=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)))

    def differences(self, other: BaseShapes) -> list[str]:
        """'field: ours vs theirs' for every field but name_or_path that differs."""
        return [f"{f.name}: {getattr(self, f.name)} vs {getattr(other, f.name)}"
                for f in fields(self)
                if f.name not in ("name_or_path", "tied", "tokenizer") and getattr(self, f.name) != getattr(other, f.name)]


def check_same_base(trained_on: str | None, base: BaseShapes, files: AdapterFiles) -> None:
    """Refuse only when trained_on is a readable local model dir that differs (module
    docstring); for a confined adapter, only one inside its root is opened."""
    if not trained_on:
        return
    model_dir = Path(trained_on)
    if not files.inside(model_dir):
        return  # never open a path an adapter names outside its root
    if Path(base.name_or_path).exists() and os.path.realpath(model_dir) == os.path.realpath(
            base.name_or_path):
        return
    other = _base_shapes(files, model_dir)
    if isinstance(other, str):  # only its model type is known
        diffs = [f"model_type: {base.model_type} vs {other}"] if other != base.model_type else []
    else:
        diffs = base.differences(other) if other is not None else []
    if diffs:
        raise AdapterError(f"{files.label()}: adapter was trained on base model {trained_on!r}, "
                           f"which differs from the served base model (served vs trained: "
                           f"{'; '.join(diffs)}); serve it with its own base model")


def _base_shapes(files: AdapterFiles, model_dir: Path) -> BaseShapes | str | None:
    """The shapes of the model dir ``model_dir`` from its config.json, opened confined to
    the adapter's root (parsed once per content); its model_type alone where it cannot be
    shaped; None if it cannot be read (then nothing can be compared): ``_shapes_of``."""
    try:
        with AdapterFiles(model_dir, files.root).open("config.json") as f:
            raw = read_all(f, "config.json")
            key = content_key(real_path(f, model_dir / "config.json"), len(raw), raw)
    except ValueError:  # missing, unreadable, outside the root (AdapterError and kin)
        return None
    return PARSED.get("base_shapes", key, lambda: _shapes_of(raw, str(model_dir)))


def _shapes_of(raw: bytes, name_or_path: str) -> BaseShapes | str | None:
    """A config.json's bytes as AutoConfig.from_pretrained reads them (the model type's
    config class, ``from_dict``): its BaseShapes; only its (text) model_type when transformers
    does not know that type or the config is not Llama-like (a field the shapes need is
    missing or unusable); None when it cannot be read (not JSON, no model_type, values the
    type's config class refuses)."""
    try:
        config = json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8 (JSONDecodeError, UnicodeDecodeError)
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        return None
    from huggingface_hub import errors as hub_errors
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return model_type
    # older huggingface_hub has no strict dataclasses; its configs raise ValueError / TypeError
    refused = (ValueError, TypeError, getattr(hub_errors, "StrictDataclassError", ValueError))
    try:
        hf_config = CONFIG_MAPPING[model_type].from_dict(config)
    except refused:
        return None
    try:
        return BaseShapes.from_hf_config(hf_config, name_or_path)
    except (AttributeError, TypeError, ArithmeticError):  # not Llama-like
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") \
            else hf_config
        return str(text_config.model_type)
