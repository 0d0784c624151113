"""Read and validate a PEFT LoRA adapter directory into float32 A / scaled-B tensors.

A servable adapter directory holds ``adapter_config.json`` (peft_type LORA) and
``adapter_model.safetensors`` whose tensors are ``<prefix>.layers.<i>.self_attn|mlp.<module>
.lora_A|lora_B[.<adapter name>].weight`` for the base's modules (``BaseShapes.modules``:
``LORA_TARGETS``, or Phi-3's fused ones). Pickle weights
(``.bin``/``.pt``/``.pth``) are refused and never unpickled. The (layer, module) pairs served
are the ones present in the file; each must be targeted by the config, a targeted pair
without tensors is left out (as PEFT with its default init, where B starts at zero).

Base model rule: ``base_model_name_or_path`` refuses the adapter only when both sides can
be compared, i.e. it names a local directory (other than the served base) whose
``config.json`` loads and differs from the served base in model_type, hidden_size,
num_layers, vocab_size or a module shape. A bare name that differs, a path that does not
exist here, or a config that cannot be read is not an error: the tensor shapes are checked anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from .peft_checks import (
    ALL_NAMES,
    LORA_TARGETS,
    MODULE_PARENT,
    SUPPORTED,
    AdapterError,
    Plan,
    check_servable,
    module_key,
    plan_modules,
    read_lora_config,
    scaling,
)

if TYPE_CHECKING:
    import transformers

__all__ = ["LORA_TARGETS", "AdapterError", "BaseShapes", "LoRAWeights", "read_peft_adapter"]

WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

TensorKeys = dict[tuple[int, str], dict[str, str]]  # (layer, module) -> {"A": key, "B": key}


@dataclass(frozen=True)
class BaseShapes:
    """What the base model accepts: (in, out) features per target module, layers, identity."""

    num_layers: int
    modules: dict[str, tuple[int, int]]  # "q_proj" -> (hidden, num_heads * head_dim), ...
    model_type: str
    name_or_path: str  # the base model dir or name, for base_model_name_or_path checks
    hidden_size: int
    vocab_size: int

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
                   hidden_size=hidden, vocab_size=config.vocab_size)

    def differences(self, other: BaseShapes) -> list[str]:
        """'field: ours vs theirs' for every field but name_or_path that differs."""
        return [f"{f.name}: {getattr(self, f.name)} vs {getattr(other, f.name)}"
                for f in fields(self)
                if f.name != "name_or_path" and getattr(self, f.name) != getattr(other, f.name)]


@dataclass
class LoRAWeights:
    name: str
    path: Path
    rank: int  # the largest rank of any module
    lora_alpha: float
    use_rslora: bool
    target_modules: list[str]  # sorted subset of the base's modules actually present
    # (layer_idx, "q_proj") -> (A [r, in] float32, B [out, r] float32, scaling multiplied in)
    layers: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    size_bytes: int  # bytes of the safetensors file
    base_model_name_or_path: str | None


def read_peft_adapter(path: str | Path, base: BaseShapes, max_lora_rank: int,
                      name: str = "") -> LoRAWeights:
    """Read the PEFT LoRA dir at ``path`` for ``base``; AdapterError says what is wrong."""
    adapter_dir = _adapter_dir(path)
    config = read_lora_config(adapter_dir)
    check_servable(config, adapter_dir)
    _check_same_base(config.base_model_name_or_path, base, adapter_dir)
    plan = plan_modules(config, base.num_layers, max_lora_rank, adapter_dir,
                        tuple(base.modules))
    weights_file = _weights_file(adapter_dir)
    layers = _read_layers(weights_file, plan, base, config.use_rslora)
    return LoRAWeights(
        name=name or adapter_dir.name, path=adapter_dir,
        rank=max(plan[pair][0] for pair in layers), lora_alpha=float(config.lora_alpha),
        use_rslora=bool(config.use_rslora),
        target_modules=sorted({m for _, m in layers}),
        layers=layers, size_bytes=weights_file.stat().st_size,
        base_model_name_or_path=config.base_model_name_or_path,
    )


def _adapter_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        kind = "is a dangling symlink" if p.is_symlink() else "does not exist"
        raise AdapterError(f"adapter path {p} {kind}; give a PEFT LoRA adapter directory")
    if not p.is_dir():
        raise AdapterError(f"adapter path {p} is a file, not a directory; give the directory "
                           "that holds adapter_config.json and adapter_model.safetensors")
    return p


def _check_same_base(trained_on: str | None, base: BaseShapes, where: Path) -> None:
    """Refuse only when trained_on is a readable local model dir that differs (module docstring)."""
    if not trained_on or not (Path(trained_on) / "config.json").is_file():
        return
    if Path(base.name_or_path).exists() and Path(trained_on).resolve() == Path(
            base.name_or_path).resolve():
        return
    try:
        from transformers import AutoConfig

        other = BaseShapes.from_hf_config(
            AutoConfig.from_pretrained(trained_on, local_files_only=True), trained_on)
    except Exception:  # noqa: BLE001  # unreadable or not Llama-like: cannot tell
        return
    diffs = base.differences(other)
    if diffs:
        raise AdapterError(f"{where}: adapter was trained on base model {trained_on!r}, which "
                           f"differs from the served base {base.name_or_path!r} (served vs "
                           f"trained: {'; '.join(diffs)}); serve it with its own base model")


def _weights_file(adapter_dir: Path) -> Path:
    path = adapter_dir / WEIGHTS_NAME
    if not path.is_file():
        pickles = sorted(p.name for p in adapter_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise AdapterError(f"{adapter_dir}: only pickle weights {pickles}, which loraplex "
                               f"never loads (unpickling can run code); save the adapter as "
                               f"{WEIGHTS_NAME} (PEFT save_pretrained with safe_serialization)")
        raise AdapterError(f"{path} is missing; the adapter weights must be in {WEIGHTS_NAME}")
    if path.stat().st_size == 0:
        raise AdapterError(f"{path} is empty (0 bytes); it must be a safetensors file")
    return path


def _read_layers(weights_file: Path, plan: Plan, base: BaseShapes,
                 use_rslora: bool) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Index, check and load every (layer, module) pair of the file; B is pre-scaled."""
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as f:
            keys = _index_tensors(list(f.keys()), weights_file)
            _check_pairs(keys, plan, base, weights_file)
            _check_shapes(f, keys, plan, base, weights_file)
            layers = {}
            for pair, ab in sorted(keys.items()):
                r, alpha = plan[pair]
                a = _load(f, ab["A"], weights_file)
                b = _load(f, ab["B"], weights_file) * scaling(r, alpha, use_rslora)
                layers[pair] = (a, b)
            return layers
    except AdapterError:
        raise
    except Exception as exc:  # SafetensorError and friends: truncated, bad header, bad offsets
        raise AdapterError(f"{weights_file} is not a readable safetensors file (truncated or "
                           f"corrupt?): {exc}") from exc


def _index_tensors(names: list[str], where: Path) -> TensorKeys:
    """Group the file's tensor names by (layer, module); every name must be a LoRA A or B."""
    if not any(".lora_" in n for n in names):
        raise AdapterError(f"{where} holds no LoRA tensors (found {sorted(names)[:5]}); expected "
                           "names like base_model.model.model.layers.0.self_attn.q_proj"
                           ".lora_A.weight")
    keys: TensorKeys = {}
    infixes: set[str | None] = set()
    for tensor in names:
        layer, module, ab, infix = _parse_name(tensor, where)
        infixes.add(infix)
        if ab in keys.setdefault((layer, module), {}):
            raise AdapterError(f"{where}: tensors {keys[(layer, module)][ab]!r} and {tensor!r} "
                               "are both lora_" + ab + f" of {module_key(layer, module)}")
        keys[(layer, module)][ab] = tensor
    if len(infixes) > 1:
        raise AdapterError(f"{where} mixes adapter names {sorted(map(str, infixes))}; "
                           "one adapter per file")
    return keys


def _parse_name(tensor: str, where: Path) -> tuple[int, str, str, str | None]:
    """``...layers.3.mlp.up_proj.lora_B[.default].weight`` -> (3, "up_proj", "B", "default")."""
    parts = tensor.split(".")
    i = next((i for i, p in enumerate(parts) if p.startswith("lora_")), None)
    if i is None:
        raise AdapterError(f"{where}: tensor {tensor!r} is not a LoRA weight (a modules_to_save "
                           "or base weight?); only lora_A / lora_B weights are allowed")
    kind, rest, module = parts[i], parts[i + 1:], parts[i - 1] if i else ""
    if module not in ALL_NAMES:
        raise AdapterError(f"{where}: tensor {tensor!r} adapts {module!r}, which the engine "
                           f"cannot wrap; {SUPPORTED}")
    if kind not in ("lora_A", "lora_B") or rest[-1:] != ["weight"] or len(rest) > 2:
        raise AdapterError(f"{where}: tensor {tensor!r} is not a lora_A / lora_B weight (DoRA "
                           "magnitudes and LoRA biases are not supported)")
    path = parts[:i]
    if len(path) < 4 or path[-4] != "layers" or not path[-3].isdigit() \
            or path[-2] != MODULE_PARENT[module]:
        raise AdapterError(f"{where}: tensor {tensor!r} is not under layers.<i>."
                           f"{MODULE_PARENT[module]}.{module} of the decoder")
    return int(path[-3]), module, kind[-1], rest[0] if len(rest) == 2 else None


def _check_pairs(keys: TensorKeys, plan: Plan, base: BaseShapes, where: Path) -> None:
    """Layer in range, both halves present, and targeted by adapter_config.json."""
    for (layer, module), ab in sorted(keys.items()):
        some = next(iter(ab.values()))
        if layer >= base.num_layers:
            raise AdapterError(f"{where}: tensor {some!r} is for layer {layer}, but the base model "
                               f"has {base.num_layers} layers (0..{base.num_layers - 1})")
        for have, lack in (("A", "B"), ("B", "A")):
            if have in ab and lack not in ab:
                raise AdapterError(f"{where}: tensor {ab[have]!r} has no matching lora_{lack}; "
                                   "every module needs both lora_A and lora_B")
        if (layer, module) not in plan:
            raise AdapterError(f"{where}: tensor {some!r} adapts {module_key(layer, module)}, "
                               "which adapter_config.json does not target (target_modules / "
                               "layers_to_transform)")


def _check_shapes(f: Any, keys: TensorKeys, plan: Plan, base: BaseShapes, where: Path) -> None:
    """A is [r, in] and B is [out, r] with r from the config and (in, out) from the base."""
    for (layer, module), ab in sorted(keys.items()):
        r = plan[(layer, module)][0]
        d_in, d_out = base.modules[module]
        for half, want in (("A", [r, d_in]), ("B", [d_out, r])):
            found = list(f.get_slice(ab[half]).get_shape())
            if found != want:
                raise AdapterError(f"{where}: tensor {ab[half]!r} has shape {found}, expected "
                                   f"{want} (r={r} from adapter_config.json, {module} of the base "
                                   f"is in={d_in}, out={d_out})")


def _load(f: Any, tensor: str, where: Path) -> torch.Tensor:
    t = f.get_tensor(tensor)
    if not t.is_floating_point():
        raise AdapterError(f"{where}: tensor {tensor!r} has dtype {t.dtype}; LoRA weights must "
                           "be floating point")
    t = t.to(torch.float32, copy=True).contiguous()  # own memory: get_tensor maps the file
    if not torch.isfinite(t).all():
        raise AdapterError(f"{where}: tensor {tensor!r} holds NaN or Inf values; all LoRA "
                           "weights must be finite")
    return t
