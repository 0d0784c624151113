"""BROKEN: the broken adapter directories of tests/server/test_bad_inputs.py, each made
from a copy of a good PEFT adapter by one edit: ``BROKEN[name](dir, extra)`` breaks ``dir``
in place (``extra["other_base"]``: a base model dir of another size; ``extra["outside"]``:
a good adapter out of the adapter root)."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from loraplex.lora.adapter_files import MAX_CONFIG_FILE_BYTES
from loraplex.lora.adapter_vocab import MAX_TOKENIZER_FILE_BYTES
from safetensors.torch import load_file

from tests.adapter_dirs import edit_config, edit_tensors

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def _first(tensors: dict[str, torch.Tensor], kind: str = "lora_A") -> str:
    return min(k for k in tensors if kind in k)


def _set(key_kind: str, value: Callable[[torch.Tensor], torch.Tensor]
         ) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(t: dict[str, torch.Tensor]) -> None:
        k = _first(t, key_kind)
        t[k] = value(t[k])
    return edit


def _poison(x: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[3] = x
        return t
    return f


def _link_out(d: Path, outside: Path, names: tuple[str, ...]) -> None:
    """``d``'s files ``names`` become symlinks to the same files of ``outside`` (a good
    adapter out of the adapter root): the directory is inside the root, the files are not."""
    for name in names:
        (d / name).unlink()
        (d / name).symlink_to(outside / name)


def _rename_layer(t: dict[str, torch.Tensor]) -> None:
    for k in [k for k in t if ".layers.0." in k]:
        t[k.replace(".layers.0.", ".layers.9.")] = t.pop(k)


BROKEN: dict[str, Callable[[Path, dict[str, Path]], None]] = {
    "no-config": lambda d, x: (d / CONFIG).unlink(),
    "no-weights": lambda d, x: (d / WEIGHTS).unlink(),
    "bad-json": lambda d, x: (d / CONFIG).write_text('{"peft_type": "LORA", "r": 8,'),
    "json-list": lambda d, x: (d / CONFIG).write_text("[1, 2, 3]"),
    "empty-config": lambda d, x: (d / CONFIG).write_bytes(b""),
    "prefix-tuning": lambda d, x: edit_config(d, peft_type="PREFIX_TUNING"),
    "dora": lambda d, x: edit_config(d, use_dora=True),
    "bias": lambda d, x: edit_config(d, bias="all"),
    "modules-to-save": lambda d, x: edit_config(d, modules_to_save=["lm_head"]),
    "embed-target": lambda d, x: edit_config(d, target_modules=["q_proj", "embed_tokens"]),
    "alora-vocab": lambda d, x: edit_config(d, alora_invocation_tokens=[41, 100000]),
    "other-base": lambda d, x: edit_config(d, base_model_name_or_path=str(x["other_base"])),
    "wrong-shape": lambda d, x: edit_tensors(d, _set("lora_A", lambda a: a[:, :32].clone())),
    "pickle-only": lambda d, x: (torch.save(load_file(d / WEIGHTS), d / "adapter_model.bin"),
                                 (d / WEIGHTS).unlink()),
    "truncated": lambda d, x: (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:3000]),
    "garbage": lambda d, x: (d / WEIGHTS).write_bytes(b"\xff" * 64),
    "empty-weights": lambda d, x: (d / WEIGHTS).write_bytes(b""),
    "nan": lambda d, x: edit_tensors(d, _set("lora_B", _poison(math.nan))),
    "inf": lambda d, x: edit_tensors(d, _set("lora_A", _poison(-math.inf))),
    "int-weights": lambda d, x: edit_tensors(d, _set("lora_A", lambda a: a.to(torch.int32))),
    "a-only": lambda d, x: edit_tensors(d, lambda t: t.pop(_first(t, "lora_B"))),
    "layer-9": lambda d, x: edit_tensors(d, _rename_layer),
    "base-tensor": lambda d, x: edit_tensors(
        d, lambda t: t.__setitem__("base_model.model.model.norm.weight", torch.ones(64))),
    # issue 42 (a): files that link out of the adapter root
    "links-out": lambda d, x: _link_out(d, x["outside"], (CONFIG, WEIGHTS)),
    "weights-link-out": lambda d, x: _link_out(d, x["outside"], (WEIGHTS,)),
    "symlink-loop": lambda d, x: (shutil.rmtree(d), d.symlink_to(d)),
}


# ---- an adapter's own token rows (issue 46 item 1): what is not served ----------------------
def _head_of_vocab(rows: int) -> Callable[[dict[str, torch.Tensor]], None]:
    """An lm_head table (modules_to_save) of ``rows`` rows, the base's width."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        t["base_model.model.lm_head.weight"] = torch.zeros(rows, t[_first(t)].shape[1])
    return edit


def _sparse(path: Path, size: int) -> None:
    """A file of ``size`` bytes that takes no disk (a hole): only its size is real."""
    with path.open("wb") as f:
        f.truncate(size)


def _with_tokenizer(d: Path, added: list[str], swap: bool = False) -> None:
    """Its base's tokenizer saved in the adapter dir with ``added`` tokens (an adapter that
    brings its own tokenizer); ``swap``: two base tokens exchange their ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(json.loads((d / CONFIG).read_text())
                                        ["base_model_name_or_path"])
    tok.add_tokens(added)
    tok.save_pretrained(d)
    if swap:
        data = json.loads((d / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]
        (d / "tokenizer.json").write_text(json.dumps(data))


BROKEN.update({
    "modules-to-save-norm": lambda d, x: edit_config(d, modules_to_save=["norm"]),
    "head-other-vocab": lambda d, x: (edit_config(d, modules_to_save=["lm_head"]),
                                      edit_tensors(d, _head_of_vocab(388))),
    "tokenizer-moves-base-ids": lambda d, x: _with_tokenizer(d, [], swap=True),
    "tokenizer-too-large": lambda d, x: _sparse(d / "tokenizer.json",
                                                MAX_TOKENIZER_FILE_BYTES + 1),
    "config-too-large": lambda d, x: _sparse(d / CONFIG, MAX_CONFIG_FILE_BYTES + 1),
    "tokenizer-other-table": lambda d, x: (edit_config(d, modules_to_save=["lm_head"]),
                                           edit_tensors(d, _head_of_vocab(388)),
                                           _with_tokenizer(d, ["<|a|>", "<|b|>"])),
})


# ---- weights that overflow the serving dtype once applied (issue 42 item 9) ----------------
def _fill(value: float, first_only: bool) -> Callable[[dict[str, torch.Tensor]], None]:
    """Every tensor (or the first module's A and B) set to ``value``: each value finite."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        a = _first(t)
        for k in [a, a.replace("lora_A", "lora_B")] if first_only else list(t):
            t[k] = torch.full_like(t[k], value)
    return edit


BROKEN.update({
    "overflow-1e30": lambda d, x: edit_tensors(d, _fill(1e30, first_only=False)),
    "overflow-product": lambda d, x: edit_tensors(d, _fill(1e20, first_only=True)),
})
