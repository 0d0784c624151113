"""The checks on a PEFT ``adapter_config.json`` (what of it the engine can serve, and where)
and on the tensors its safetensors header lists (names, pairs, shapes, dtypes).

Matching follows PEFT itself: ``target_modules`` and ``layers_to_transform`` go through
``peft.tuners.tuners_utils.check_target_module_exists`` and ``rank_pattern`` /
``alpha_pattern`` through ``peft.utils.other.get_pattern_key``, both applied to the module
keys PEFT sees on the base model (``model.layers.{i}.self_attn.q_proj``, ...). Which
modules those are depends on the family: the Llama family and Gemma have q/k/v/o and
gate/up/down (``LORA_TARGETS``); Phi-3 stores q/k/v and gate/up fused, so its adapters
target ``qkv_proj`` and ``gate_up_proj`` (``FUSED_TARGETS``) besides o_proj and down_proj.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from pathlib import Path

from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key, match_target_against_key

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3
MODULE_PARENT = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
    "qkv_proj": "self_attn", "gate_up_proj": "mlp",
}
ALL_NAMES = tuple(MODULE_PARENT)  # every module name some family's adapters may target
ALL_LINEAR = "all-linear"
SUPPORTED = (f"supported target modules: {', '.join(LORA_TARGETS)} (Phi-3: "
             f"{', '.join(FUSED_TARGETS)})")
SERVES = ("loraplex serves plain LoRA, rsLoRA, DoRA and activated LoRA "
          "(alora_invocation_tokens) on the linear layers of the decoder")
# PEFT's variants the engine serves: aLoRA is plain LoRA applied from its invocation on
# (engine/activation.py finds where; the ModelRunner gives earlier tokens the base path);
# ``use_dora``: lora/dora_gains.py
_SERVED_VARIANTS = ("alora_invocation_tokens", "use_dora")
# Config fields that change the forward pass beyond `scaling * (B(A(x)) + b)` (b: lora_B's
# bias, ``lora_bias=True``), besides the ones PEFT
# itself tags as LoRA variants (DoRA, aLoRA, KaSA, ...; see `_active_variants`).
_UNSERVABLE_FIELDS = {
    "use_qalora": "QA-LoRA (use_qalora)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "LoRA on parameters (target_parameters)",
}

Plan = dict[tuple[int, str], tuple[int, float]]  # (layer, module) -> (r, alpha)
# (layer, module) -> {"A": key, "B": key[, "b": key of lora_B's bias (lora_bias)]
#                      [, "m": key of DoRA's magnitude vector (use_dora)]}
TensorKeys = dict[tuple[int, str], dict[str, str]]
Header = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (safetensors dtype, shape)
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")  # read as float32
# the names PEFT saves: <prefix>.layers.<i>.<parent>.<module>.lora_A|B[.<adapter name>].weight
_LORA_NAME = re.compile(r"((?:(?!lora_)[^.]*\.)*)layers\.([0-9]+)\.([^.]+)\.([^.]+)"
                        r"\.lora_([AB])(?:\.([^.]+))?\.weight")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the problem and what is allowed."""


def module_key(layer: int, module: str) -> str:
    """The base-model module name PEFT matches: ``model.layers.0.self_attn.q_proj``."""
    return f"model.layers.{layer}.{MODULE_PARENT[module]}.{module}"


def parse_lora_config(raw: bytes, where: str | Path) -> LoraConfig:
    """``adapter_config.json``'s bytes (as read, once: peft_files.lora_config) through PEFT's
    own checks, as ``LoraConfig.from_json_file`` reads them; refuse anything but a LoRA
    config. ``where`` names the file in messages."""
    if not raw:
        raise AdapterError(f"{where} is empty; it must be the JSON object PEFT writes")
    try:
        raw_obj = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise AdapterError(f"{where} is not readable JSON: {exc}") from exc
    if not isinstance(raw_obj, dict):
        raise AdapterError(f"{where} holds a JSON {type(raw_obj).__name__}; it must be a "
                           "JSON object")
    raw_obj.pop("runtime_config", None)  # PEFT's from_json_file ignores it too
    if raw_obj.get("peft_type") != "LORA":
        raise AdapterError(f"{where}: peft_type is {raw_obj.get('peft_type')!r}, not a LoRA "
                           "adapter; only peft_type 'LORA' can be served")
    try:
        return LoraConfig.from_peft_type(**LoraConfig.check_kwargs(**raw_obj))
    except Exception as exc:  # PEFT validates in __post_init__ with ValueError/TypeError/...
        raise AdapterError(f"{where}: PEFT rejects this LoRA config: {exc}") from exc


def check_servable(config: LoraConfig, where: str | Path) -> None:
    """Refuse the features that the engine's ``base(x) + scaling * B(A(x))`` cannot express."""
    variants = [v for v in _active_variants(config) if v not in _SERVED_VARIANTS]
    if variants:
        name = variants[0]
        raise AdapterError(f"{where}: the LoRA variant {name}={getattr(config, name)!r} is not "
                           f"supported (it changes the forward pass); {SERVES}")
    for name, what in _UNSERVABLE_FIELDS.items():
        if getattr(config, name, None):
            raise AdapterError(f"{where}: {what} is not supported; {SERVES}")
    # modules_to_save and trainable_token_indices: lora/token_rows.py (check_token_config)
    if config.bias != "none":
        raise AdapterError(f"{where}: bias={config.bias!r} is not supported; only bias='none'")
    _check_target_names(config, where)


def invocation_tokens(config: LoraConfig, vocab_size: int, where: str | Path
                      ) -> tuple[int, ...] | None:
    """An activated LoRA's invocation sequence (``alora_invocation_tokens``), None for any
    other adapter (an empty list is none: PEFT then serves it as plain LoRA). Each must be
    a token id of the base's vocabulary: a sequence that no prompt can hold would never
    activate the adapter."""
    tokens = config.alora_invocation_tokens
    if not tokens:
        return None
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
            for t in tokens):
        raise AdapterError(f"{where}: alora_invocation_tokens={tokens!r} must be a list of "
                           f"token ids of the base model's vocabulary (0 to {vocab_size - 1})")
    return tuple(tokens)


def _active_variants(config: LoraConfig) -> list[str]:
    """The fields PEFT's own metadata marks as LoRA variants that this config switches on."""
    active = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        flagged = bool(f.metadata.get("is_lora_variant") and value)
        if f.name in _SERVED_VARIANTS:
            continue
        if flagged or value in f.metadata.get("lora_variants", ()):  # init_lora_weights="mica"
            active.append(f.name)
    return active


def _check_target_names(config: LoraConfig, where: str | Path) -> None:
    """Every listed target ends in a wrappable module; a regex matches no embedding or head."""
    targets = config.target_modules
    if not targets:
        raise AdapterError(f"{where}: target_modules is empty; {SUPPORTED}")
    if isinstance(targets, str):
        if targets.lower() == ALL_LINEAR:
            return
        try:
            re.compile(targets)
        except re.error as exc:
            raise AdapterError(f"{where}: target_modules {targets!r} is not a valid regex: "
                               f"{exc}") from exc
        for key in ("model.embed_tokens", "lm_head"):
            if match_target_against_key(targets, key):
                raise AdapterError(f"{where}: target_modules {targets!r} matches {key!r}, which "
                                   f"the engine cannot wrap; {SUPPORTED}")
        return
    for target in sorted(targets):
        if target.split(".")[-1] not in ALL_NAMES:
            raise AdapterError(f"{where}: target module {target!r} cannot be wrapped by the "
                               f"engine; {SUPPORTED}")


def plan_modules(config: LoraConfig, num_layers: int, max_lora_rank: int, where: str | Path,
                 modules: tuple[str, ...] = LORA_TARGETS) -> Plan:
    """(layer, module) -> (r, alpha) for each of the base's ``modules`` the config targets in
    ``num_layers`` layers."""
    matcher = config
    if isinstance(config.target_modules, str) and config.target_modules.lower() == ALL_LINEAR:
        matcher = copy.copy(config)  # PEFT expands "all-linear" against the model; lm_head excluded
        matcher.target_modules = set(modules)
    plan: Plan = {}
    for layer in range(num_layers):
        for module in modules:
            key = module_key(layer, module)
            if check_target_module_exists(matcher, key):
                plan[(layer, module)] = _rank_alpha(config, key, max_lora_rank, where)
    if not plan:
        raise AdapterError(f"{where}: target_modules={_shown(config.target_modules)} with "
                           f"layers_to_transform={config.layers_to_transform} matches no module of "
                           f"this {num_layers}-layer base model, whose modules are "
                           f"{', '.join(modules)}; {SUPPORTED}")
    return plan


def _rank_alpha(config: LoraConfig, key: str, max_lora_rank: int, where: str | Path
                ) -> tuple[int, float]:
    """The module's (r, alpha), with rank_pattern / alpha_pattern applied exactly as PEFT does."""
    rank_pattern = config.rank_pattern or {}
    alpha_pattern = config.alpha_pattern or {}
    r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), key), config.r)
    alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), key), config.lora_alpha)
    if not isinstance(r, int) or r <= 0:
        raise AdapterError(f"{where}: rank {r!r} of {key} must be a positive integer")
    if r > max_lora_rank:
        source = "rank_pattern" if key_matches(rank_pattern, key) else "r"
        raise AdapterError(f"{where}: rank {r} of {key} (from {source}) is above max_lora_rank="
                           f"{max_lora_rank}; serve it with --max-lora-rank {r} or more")
    return r, float(alpha)


def key_matches(pattern: dict, key: str) -> bool:
    return get_pattern_key(pattern.keys(), key) in pattern


def scaling(r: int, alpha: float, use_rslora: bool) -> float:
    """PEFT's LoRA scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def _shown(targets: object) -> object:
    return sorted(targets) if isinstance(targets, (set, frozenset)) else targets


# ---- the tensors of the safetensors header ------------------------------------------------------


def index_tensors(names: list[str], where: str | Path) -> TensorKeys:
    """Group the file's tensor names by (layer, module); every name must be a LoRA A or B."""
    if not any(".lora_" in n for n in names):
        raise AdapterError(f"{where} holds no LoRA tensors (found {sorted(names)[:5]}); expected "
                           "names like base_model.model.model.layers.0.self_attn.q_proj"
                           ".lora_A.weight")
    keys: TensorKeys = {}
    infixes: set[str | None] = set()
    for tensor in names:
        layer, module, ab, infix = parse_name(tensor, where)
        infixes.add(infix)
        if ab in keys.setdefault((layer, module), {}):
            raise AdapterError(f"{where}: tensors {keys[(layer, module)][ab]!r} and {tensor!r} "
                               "are both lora_" + ab + f" of {module_key(layer, module)}")
        keys[(layer, module)][ab] = tensor
    if len(infixes) > 1:
        raise AdapterError(f"{where} mixes adapter names {sorted(map(str, infixes))}; "
                           "one adapter per file")
    return keys


def parse_name(tensor: str, where: str | Path) -> tuple[int, str, str, str | None]:
    """``...layers.3.mlp.up_proj.lora_B[.default].weight`` -> (3, "up_proj", "B", "default")."""
    m = _LORA_NAME.fullmatch(tensor)
    if m and m[4] in MODULE_PARENT and MODULE_PARENT[m[4]] == m[3]:  # the common case, at once
        return int(m[2]), m[4], m[5], m[6]
    parts = tensor.split(".")
    i = next((i for i, p in enumerate(parts) if p.startswith("lora_")), None)
    if i is None:
        raise AdapterError(f"{where}: tensor {tensor!r} is not a LoRA weight (a modules_to_save "
                           "or base weight?); only lora_A / lora_B weights are allowed")
    kind, rest, module = parts[i], parts[i + 1:], parts[i - 1] if i else ""
    if module not in ALL_NAMES:
        raise AdapterError(f"{where}: tensor {tensor!r} adapts {module!r}, which the engine "
                           f"cannot wrap; {SUPPORTED}")
    bias = kind == "lora_B" and rest[-1:] == ["bias"]  # lora_bias=True: lora_B's bias
    # DoRA's magnitude: PEFT saves ``<module>.lora_magnitude_vector`` (no ``.weight``)
    magnitude = kind == "lora_magnitude_vector" and rest[-1:] in ([], ["weight"])
    if magnitude and rest[-1:] == []:
        rest = [*rest, "weight"]
    if kind not in ("lora_A", "lora_B", "lora_magnitude_vector") \
            or (rest[-1:] != ["weight"] and not bias) or len(rest) > 2 \
            or (kind == "lora_magnitude_vector" and not magnitude):
        raise AdapterError(f"{where}: tensor {tensor!r} is not a lora_A / lora_B weight, "
                           "lora_B's bias nor a DoRA magnitude vector")
    path = parts[:i]
    if len(path) < 4 or path[-4] != "layers" or not path[-3].isdigit() \
            or path[-2] != MODULE_PARENT[module]:
        raise AdapterError(f"{where}: tensor {tensor!r} is not under layers.<i>."
                           f"{MODULE_PARENT[module]}.{module} of the decoder")
    half = "b" if bias else "m" if magnitude else kind[-1]
    return int(path[-3]), module, half, rest[0] if len(rest) == 2 else None


def check_pairs(keys: TensorKeys, plan: Plan, num_layers: int, where: str | Path) -> None:
    """Layer in range, both halves present, and targeted by adapter_config.json."""
    for (layer, module), ab in sorted(keys.items()):
        some = next(iter(ab.values()))
        if layer >= num_layers:
            raise AdapterError(f"{where}: tensor {some!r} is for layer {layer}, but the base model "
                               f"has {num_layers} layers (0..{num_layers - 1})")
        for have, lack in (("A", "B"), ("B", "A"), ("b", "B"), ("m", "B")):
            if have in ab and lack not in ab:
                raise AdapterError(f"{where}: tensor {ab[have]!r} has no matching lora_{lack}; "
                                   "every module needs both lora_A and lora_B")
        if (layer, module) not in plan:
            raise AdapterError(f"{where}: tensor {some!r} adapts {module_key(layer, module)}, "
                               "which adapter_config.json does not target (target_modules / "
                               "layers_to_transform)")


def check_shapes(header: Header, keys: TensorKeys, plan: Plan,
                 modules: dict[str, tuple[int, int]], where: str | Path) -> None:
    """A is [r, in], B is [out, r], lora_B's bias and DoRA's magnitude (if any) are [out],
    with r from the config and (in, out) from the base."""
    for (layer, module), ab in sorted(keys.items()):
        r = plan[(layer, module)][0]
        d_in, d_out = modules[module]
        for half, want in (("A", (r, d_in)), ("B", (d_out, r)), ("b", (d_out,)),
                           ("m", (d_out,))):
            if half not in ab:
                continue
            found = header[ab[half]][1]
            if found != want:
                raise AdapterError(f"{where}: tensor {ab[half]!r} has shape {list(found)}, "
                                   f"expected {list(want)} (r={r} from adapter_config.json, "
                                   f"{module} of the base is in={d_in}, out={d_out})")


def check_biases(keys: TensorKeys, lora_bias: bool, where: str | Path) -> None:
    """lora_B biases only where adapter_config.json says ``lora_bias=True`` (PEFT would
    not read them otherwise)."""
    if lora_bias:
        return
    for _, ab in sorted(keys.items()):
        if "b" in ab:
            raise AdapterError(f"{where}: tensor {ab['b']!r} is a bias of lora_B, but "
                               "adapter_config.json has lora_bias=false")


def check_magnitudes(keys: TensorKeys, use_dora: bool, where: str | Path) -> None:
    """DoRA (``use_dora=True``): every module has its magnitude vector (PEFT saves one per
    adapted module; without it the weight's direction has no length); without DoRA none
    (PEFT would not read it)."""
    for (layer, module), ab in sorted(keys.items()):
        if use_dora and "m" not in ab:
            raise AdapterError(f"{where}: {module_key(layer, module)} has no "
                               "lora_magnitude_vector, but adapter_config.json has "
                               "use_dora=true (DoRA needs one per adapted module)")
        if not use_dora and "m" in ab:
            raise AdapterError(f"{where}: tensor {ab['m']!r} is a DoRA magnitude vector, but "
                               "adapter_config.json has use_dora=false")


def check_dtypes(header: Header, keys: TensorKeys, where: str | Path) -> None:
    for _, ab in sorted(keys.items()):
        for tensor in ab.values():
            dtype = header[tensor][0]
            if dtype not in FLOAT_DTYPES:
                raise AdapterError(f"{where}: tensor {tensor!r} has dtype {dtype}; LoRA weights "
                                   f"must be floating point ({', '.join(FLOAT_DTYPES)})")
