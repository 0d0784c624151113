"""Shared fixtures: tiny random HF models and real PEFT adapters, made on the fly.

TRITON_INTERPRET must be set before any ``@triton.jit`` definition is imported.
"""

from __future__ import annotations

import os
import platform
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The Triton interpreter's tl.dot is numpy's matmul (OpenBLAS). OpenBLAS's Haswell/Zen sgemm
# kernels give a row different bits by its place in the block (edge rows take another micro-
# kernel), unlike a GPU's MMA tiles; the batch-invariance tests of the Triton kernels would
# test OpenBLAS then. Its AVX (Sandybridge) kernels treat every row alike: pinned here, before
# numpy is loaded (torch's own GEMMs do not use it).
if platform.machine() in ("x86_64", "AMD64") and "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if os.environ["TRITON_INTERPRET"] == "1":  # same programs, same results: no nested re-patching
    from tests.triton_interpreter import install as install_interpreter_shortcut

    install_interpreter_shortcut()

if TYPE_CHECKING:
    from loraplex.lora.base_shapes import BaseShapes

TINY_COMMON = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

WORDS = (  # noqa: SIM905 - a paragraph of words reads better than a list
    "the a of to and in is was for on with as by at from that this it be are or an "
    "cat dog sql json paris france capital river model adapter token answer query table "
    "select where order group count sum avg user name city country one two three four five"
).split()


def _make_tokenizer(out_dir: Path) -> None:
    """A small word-level tokenizer with special tokens and a chat template, saved as HF files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,?!":
        vocab.setdefault(c, len(vocab))
    while len(vocab) < TINY_COMMON["vocab_size"]:  # every model id decodes to a word
        vocab[f"w{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    fast.save_pretrained(out_dir)


def make_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random ``arch`` (llama | qwen2 | qwen3 | mistral | mistral_window | gemma2
    | gemma3 | phi3) model with a tokenizer. The windowed ones slide an 8-token window, so
    the test prompts run past it."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg_kwargs = {**TINY_COMMON, **overrides}
    if arch == "llama":
        config = tf.LlamaConfig(**cfg_kwargs, tie_word_embeddings=False)
    elif arch == "mistral":
        config = tf.MistralConfig(**cfg_kwargs, tie_word_embeddings=False, sliding_window=None)
    elif arch == "qwen2":
        config = tf.Qwen2Config(**cfg_kwargs, tie_word_embeddings=True, use_sliding_window=False)
    elif arch == "qwen3":
        config = tf.Qwen3Config(**cfg_kwargs, head_dim=32, tie_word_embeddings=True,
                                use_sliding_window=False)
    elif arch in NEW_FAMILIES:
        config = NEW_FAMILIES[arch](tf, cfg_kwargs)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # spread the weights so that greedy decoding is not degenerate
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.02)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _make_tokenizer(out_dir)
    return out_dir


def _gemma2(tf, kw: dict):
    """Every Gemma 2 part: soft-caps small enough to bite, query_pre_attn_scalar != head_dim,
    sliding (window 8) and global layers alternating."""
    return tf.Gemma2Config(**kw, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                           attn_logit_softcapping=3.0, final_logit_softcapping=4.0,
                           tie_word_embeddings=True, attn_implementation="eager")


def _gemma3(tf, kw: dict):
    """Gemma 3 text: two sliding layers to one global one, a local RoPE base apart from the
    global one, linear scaling on the global layers, q/k norms."""
    kw = {**kw, "num_hidden_layers": 3}
    return tf.Gemma3TextConfig(
        **kw, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 10000.0}},
        tie_word_embeddings=True, attn_implementation="eager")


def _phi3(tf, kw: dict):
    """Phi-3 with longrope switching at position 32 (original_max_position_embeddings)."""
    half = 8  # head_dim 16 / 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.5 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": 32}
    return tf.Phi3Config(**kw, rope_parameters=rope, original_max_position_embeddings=32,
                         tie_word_embeddings=False)


def _mistral_window(tf, kw: dict):
    return tf.MistralConfig(**kw, tie_word_embeddings=False, sliding_window=8)


NEW_FAMILIES = {"gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3,
                "mistral_window": _mistral_window}

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    out_dir: Path,
    r: int = 8,
    target_modules: Sequence[str] | str = ("q_proj", "v_proj"),
    seed: int = 0,
    lora_alpha: float | None = None,
    use_rslora: bool = False,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
    layers_to_transform: list[int] | None = None,
    scale: float = 0.15,
    lora_bias: bool = False,
    use_dora: bool = False,
) -> Path:
    """Save a real PEFT LoRA adapter for ``base_dir`` with random (non-zero) A and B (and
    lora_B's biases, with ``lora_bias``; with ``use_dora``, DoRA's magnitudes: PEFT's own,
    the base's row norms, each times a random 1 ± ``scale``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha if lora_alpha is not None else 2 * r,
        target_modules=list(target_modules) if not isinstance(target_modules, str)
        else target_modules,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        layers_to_transform=layers_to_transform,
        lora_dropout=0.0,
        bias="none",
        lora_bias=lora_bias,
        use_dora=use_dora,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.0 + scale * torch.randn_like(p))
            elif "lora_" in name:
                p.normal_(0.0, scale)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session", autouse=True)
def session_loraplex_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """$LORAPLEX_HOME is a session temp dir (a test may set its own), so what tests keep
    there (temp GGUFs' metadata, their conversions) is gone with the session; its
    default-model entries link the machine's home, filled there once per machine."""
    from loraplex.engine.default_gguf import GGUF_NAME, gguf_cache_dir, loraplex_home
    from loraplex.engine.embedded_model import DEFAULT_MODEL_NAME

    real = loraplex_home() / "models"
    home = tmp_path_factory.mktemp("loraplex_home")
    links = [GGUF_NAME, DEFAULT_MODEL_NAME]
    if (real / GGUF_NAME).is_file():
        links.append(gguf_cache_dir(real / GGUF_NAME, "gguf-meta").name)
    (home / "models").mkdir()
    for name in links:
        (home / "models" / name).symlink_to(real / name)
    before = os.environ.get("LORAPLEX_HOME")
    os.environ["LORAPLEX_HOME"] = str(home)
    yield home
    if before is None:
        os.environ.pop("LORAPLEX_HOME", None)
    else:
        os.environ["LORAPLEX_HOME"] = before


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_models(arch) -> model dir, made once per session and arch."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch)
        return made[arch]

    return get


@pytest.fixture()
def adapter_factory(tmp_path: Path) -> Callable[..., Path]:
    """adapter_factory(base_dir, name, **make_adapter_kwargs) -> a PEFT dir under tmp_path."""

    def make(base_dir: Path, name: str, **kwargs) -> Path:
        return make_adapter(base_dir, tmp_path / name, **kwargs)

    return make


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread on the calling thread, restored after. The oracles (transformers,
    PEFT) of the tiny models run in it: with 2 OpenMP threads on 2 cores, a tiny forward
    waits on a core that another process or the engine thread's spinning pool holds
    (0.25 s against 2 ms on one thread at load ~2.5). Greedy tokens are the same as with
    2 threads, float32 logprobs within 1e-6 (checked on 36 runs: 6 families, base and LoRA)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        yield
    finally:
        torch.set_num_threads(threads)


def rows_one_by_one(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                    step: int) -> torch.Tensor:
    """fn of every ``step``-th row of x alone, on one thread: the rows to compare with a
    batched, multi-threaded call (x[::step])."""
    with one_thread():
        return torch.cat([fn(x[i:i + 1]) for i in range(0, x.shape[0], step)])


def assert_bf16_linear_exact(linear: Callable[[torch.Tensor], torch.Tensor],
                             weight: torch.Tensor, bias: torch.Tensor | None,
                             rows: Sequence[int], gen: torch.Generator) -> None:
    """A packed bf16 linear against F.linear in float64 on random x of each row count:
    one rounding to bf16 (2^-8 relative) after an fp32 sum of k exact products; 0 rows
    give an empty [0, n]."""
    n, k = weight.shape
    for count in rows:
        x = torch.randn(count, k, generator=gen).bfloat16()
        exact = torch.nn.functional.linear(x.double(), weight.double(),
                                           None if bias is None else bias.double())
        y = linear(x)
        assert y.dtype == torch.bfloat16 and y.shape == (count, n)
        torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-5 * k**0.5)
    assert linear(torch.randn(0, k).bfloat16()).shape == (0, n)


def greedy_logprobs(model: torch.nn.Module, prompt: list[int], new: int
                    ) -> tuple[list[int], list[float]]:
    """The oracle's greedy ``new`` tokens after ``prompt`` (transformers' ``generate`` on
    ``model``, a base or a PeftModel, in eval mode) and each one's log_softmax logprob."""
    with torch.no_grad(), one_thread():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    tokens = ids[0, len(prompt):]
    logprobs = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), logprobs.tolist()


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


# ---- PEFT-format tests: one real adapter directory and copies of it to break ----------


@pytest.fixture(scope="module")
def good(tiny_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real llama adapter, r=8 on q_proj and v_proj of both layers; copied, never edited."""
    return make_adapter(tiny_models("llama"), tmp_path_factory.mktemp("good") / "adapter")


@pytest.fixture()
def ad(good: Path, tmp_path: Path) -> Path:
    """A private copy of ``good`` to break."""
    return Path(shutil.copytree(good, tmp_path / "adapter"))


@pytest.fixture()
def llama(tiny_models: Callable[[str], Path]) -> BaseShapes:
    """The tiny llama's shapes, as adapters are checked against them."""
    from tests.adapter_dirs import shapes_of

    return shapes_of(tiny_models("llama"))
