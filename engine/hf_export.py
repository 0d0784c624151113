"""A transformers model written as a plain Hugging Face directory: model.safetensors,
config.json, generation_config.json and the GGUF's tokenizer files (what the float32
conversion of a GGUF, embedded_model.py, writes); transformers' progress bars on or off."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def save_model_files(model: PreTrainedModel, out: Path) -> None:
    """Write model.safetensors, config.json (no quantization_config) and generation_config.json.

    Tied embeddings: ``lm_head.weight`` is the same tensor as ``embed_tokens.weight``, so it
    is left out of the file and ``tie_word_embeddings: true`` stays in config.json -- the
    layout of the upstream HF checkpoint. Loaders (transformers, ours) re-tie it from config.
    """
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tied = _lm_head_is_tied(model)
    if tied:
        del state["lm_head.weight"]
    weights = out / "model.safetensors"
    save_file(state, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors writes 0600; the cache is meant to be readable

    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are dense now
    for private in ("_name_or_path", "_model_name_or_path"):  # would leak the temp dir
        config.pop(private, None)
    config["tie_word_embeddings"] = tied
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(str(out))


def _lm_head_is_tied(model: PreTrainedModel) -> bool:
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    return head is not None and head.weight.data_ptr() == embed.weight.data_ptr()


def save_tokenizer_files(gguf_path: Path, out: Path, require_chat_template: bool = True) -> None:
    """Save the GGUF's tokenizer (with its chat template) as HF tokenizer files.

    tokenizer_config.json is made portable: a class name every transformers version knows,
    the model's real context length, and the chat template inline as well as in
    chat_template.jinja (older transformers read only the former). A file that carries no
    tokenizer gets none (unless ``require_chat_template``: RuntimeError); the engine then
    takes token ids, as it does serving the file as it is.
    """
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    if "tokenizer.ggml.model" not in GGUFReader(str(gguf_path)).fields:
        if require_chat_template:
            raise RuntimeError(f"{gguf_path.name} carries no tokenizer")
        return
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tok.chat_template and require_chat_template:
        raise RuntimeError(f"{gguf_path.name} carries no tokenizer.chat_template")
    tok.save_pretrained(str(out))
    max_len = json.loads((out / "config.json").read_text())["max_position_embeddings"]
    path = out / "tokenizer_config.json"
    tc = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):  # facts about the temp dir, not the model
        tc.pop(key, None)
    tc.update(
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=max_len,
    )
    if tok.chat_template:
        tc["chat_template"] = tok.chat_template
    path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")



@contextmanager
def transformers_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' tqdm bars for the duration; both switches are restored.

    The dequantize bar is a bare ``tqdm`` in ``modeling_gguf_pytorch_utils`` that ignores
    transformers' switch (and tqdm reads ``TQDM_DISABLE`` only at import), so to hide it that
    module's ``tqdm`` name is swapped for a disabled one while the model loads.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    bare_tqdm = getattr(gguf_utils, "tqdm", None)
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
        if bare_tqdm is not None:
            gguf_utils.tqdm = functools.partial(bare_tqdm, disable=True)
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
        if bare_tqdm is not None:
            gguf_utils.tqdm = bare_tqdm
