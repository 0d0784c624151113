"""An adapter's own tokenizer (issue 46 item 1): a fine-tune that adds tokens saves its
tokenizer next to its weights (``tokenizer.save_pretrained(adapter_dir)``), resizes the
embedding (``resize_token_embeddings(len(tokenizer))``) and trains the new rows
(``modules_to_save`` of embed_tokens / lm_head, or ``trainable_token_indices``).

``adapter_vocabulary`` loads such a tokenizer at inspection (transformers' AutoTokenizer,
from copies of the tokenizer files read through ``AdapterFiles``, so a confined adapter's
tokenizer is read inside its root as its weights are) and checks that it EXTENDS the
base's: every base token keeps its id (else AdapterError naming the first that moved).

Invariants:
- a tokenizer equal to the base's (same backend definition, chat template and special
  tokens) is not kept: the adapter is served with the base's (``None``);
- the verdict (an ``AdapterVocab``, or None for the base's tokenizer) is shared by every
  adapter whose tokenizer files hold the same bytes, over the same base tokenizer
  (``_LOADED``: a small LRU keyed by their digest), so N adapters of one fine-tune hold
  one tokenizer, and a re-inspection (a re-read after an eviction) loads and compares
  nothing again;
- a tokenizer without a chat template gets the base's (vLLM's LoRA tokenizers fall back
  to the base's template too), so chat on such an adapter renders the base's template;
- ``size`` is max(len(tokenizer), base vocab_size): the rows of the adapter's embedding and
  head tables, and the logits' width on its rows; ids >= the base's vocab_size are the
  added tokens, and ``check_covered`` requires the adapter to hold their embedding AND head
  rows (PEFT would otherwise serve the random rows of a resize that were never saved);
- no tokenizer file over ``MAX_TOKENIZER_FILE_BYTES`` is read (its size is checked on the
  open descriptor first), so the parse's time and memory are bounded.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .adapter_files import AdapterFiles, MissingFile, read_all
from .peft_checks import AdapterError

# what ``save_pretrained`` of a tokenizer writes (any of them may be absent)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "tokenizer.model", "vocab.json", "merges.txt")
MARKERS = ("tokenizer.json", "tokenizer_config.json")  # a directory with one has a tokenizer
_KEEP = 16  # tokenizers held by content (each shared by every adapter that has it)
# The most bytes one tokenizer file may hold: well above real ones (Llama 3's tokenizer.json
# is 9 MB, Gemma 3's 33 MB), so a file a client chose is never read or parsed past it.
MAX_TOKENIZER_FILE_BYTES = 64 << 20


@dataclass(frozen=True, eq=False)
class AdapterVocab:
    """An adapter's own tokenizer and the vocabulary size its rows are served with."""

    tokenizer: Any  # a transformers tokenizer
    size: int  # max(len(tokenizer), base vocab_size)
    base_size: int  # the base model's vocab_size

    @property
    def added(self) -> int:
        """Tokens beyond the base model's vocabulary."""
        return self.size - self.base_size


# (digest of the files, id of the base tokenizer, base size) -> (that base tokenizer, held
# so that its id is not reused while the entry lives; the verdict)
_LOADED: OrderedDict[tuple[str, int, int], tuple[Any, AdapterVocab | None]] = OrderedDict()
_LOCK = threading.Lock()


def adapter_vocabulary(files: AdapterFiles, base_tokenizer: Any | None, base_size: int
                       ) -> AdapterVocab | None:
    """The adapter directory's own tokenizer, checked against the base's; None when it has
    none, or one equal to the base's (module docstring)."""
    raw = _tokenizer_files(files)
    if not any(name in raw for name in MARKERS):
        return None
    where = files.label()
    if base_tokenizer is None:
        raise AdapterError(f"{where}: the adapter brings a tokenizer, but the base model has "
                           "none to check it against; serve a base model with its tokenizer")
    key = (_digest(raw), id(base_tokenizer), base_size)
    with _LOCK:
        if key in _LOADED:
            _LOADED.move_to_end(key)
            return _LOADED[key][1]
    tokenizer = _load(raw, where)
    if not getattr(tokenizer, "chat_template", None):  # vLLM's LoRA tokenizers do the same
        tokenizer.chat_template = getattr(base_tokenizer, "chat_template", None)
    vocab = None
    if not _same(tokenizer, base_tokenizer):
        check_extends(tokenizer, base_tokenizer, where)
        vocab = AdapterVocab(tokenizer, max(len(tokenizer), base_size), base_size)
    with _LOCK:
        _LOADED[key] = (base_tokenizer, vocab)
        while len(_LOADED) > _KEEP:
            _LOADED.popitem(last=False)
    return vocab


def _tokenizer_files(files: AdapterFiles) -> dict[str, bytes]:
    """The tokenizer files present, each read whole after its size was checked."""
    raw = {}
    for name in TOKENIZER_FILES:
        try:
            with files.open(name) as f:
                raw[name] = read_all(f, files.label(name), MAX_TOKENIZER_FILE_BYTES,
                                     "an adapter's tokenizer file")
        except MissingFile:
            continue
    return raw


def _digest(raw: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(raw):
        digest.update(name.encode() + b"\0" + hashlib.sha256(raw[name]).digest())
    return digest.hexdigest()


def _load(raw: dict[str, bytes], where: str) -> Any:
    """The tokenizer of these files (AutoTokenizer, local files only, no remote code)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="loraplex-tokenizer-") as tmp:
        for name, data in raw.items():
            (Path(tmp) / name).write_bytes(data)
        try:
            tokenizer = AutoTokenizer.from_pretrained(tmp, local_files_only=True,
                                                      trust_remote_code=False)
        except Exception as exc:  # noqa: BLE001 - any loader failure is the files' fault
            said = str(exc).replace(tmp, where)[:200]  # never the server's temp dir
            raise AdapterError(f"{where}: its tokenizer cannot be loaded "
                               f"({type(exc).__name__}: {said})") from None
    return tokenizer


def _same(tokenizer: Any, base: Any) -> bool:
    """The same tokenizer as the base's: same vocabulary, rules, chat template, specials."""
    backend, base_backend = (getattr(t, "backend_tokenizer", None) for t in (tokenizer, base))
    if backend is None or base_backend is None:
        same_rules = tokenizer.get_vocab() == base.get_vocab()
    else:
        same_rules = backend.to_str() == base_backend.to_str()
    return same_rules and len(tokenizer) == len(base) \
        and getattr(tokenizer, "chat_template", None) == getattr(base, "chat_template", None) \
        and tokenizer.special_tokens_map == base.special_tokens_map


def check_extends(tokenizer: Any, base: Any, where: str) -> None:
    """Every token of the base's vocabulary has the same id in ``tokenizer``'s."""
    ours = tokenizer.get_vocab()
    for token, i in sorted(base.get_vocab().items(), key=lambda kv: kv[1]):
        if ours.get(token) != i:
            now = "is missing" if token not in ours else f"has id {ours[token]}"
            raise AdapterError(
                f"{where}: its tokenizer does not extend the base model's: token {token!r} "
                f"(id {i} in the base's) {now} in the adapter's; an adapter's tokenizer may "
                "only add tokens after the base's (tokenizer.add_tokens)")


def check_covered(vocab: AdapterVocab, embed: bool, head: bool, indices: tuple[int, ...],
                  where: str) -> None:
    """The adapter holds the embedding and head rows of every added token: ``embed`` /
    ``head``: whole tables (vocab.size rows); ``indices``: trainable token ids (their rows
    are the embedding's, and the head's only where ``head`` says so)."""
    new = range(vocab.base_size, vocab.size)
    if not new:
        return
    lacking = [] if embed else sorted(set(new) - set(indices))
    if lacking:
        raise AdapterError(
            f"{where}: its tokenizer adds {vocab.added} tokens (ids {new.start}..{new.stop - 1})"
            f", but the adapter holds no embedding rows for ids {lacking[:5]}; train them "
            "(modules_to_save=['embed_tokens', 'lm_head'] or trainable_token_indices)")
    if not head:
        raise AdapterError(
            f"{where}: its tokenizer adds {vocab.added} tokens (ids {new.start}..{new.stop - 1})"
            ", but the adapter holds no logits-head rows for them (modules_to_save "
            "'lm_head', or trainable_token_indices on a base whose head is tied)")
