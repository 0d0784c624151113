"""Quantized modules of the served model: QuantizedLinear and QuantizedEmbedding hold their
weights as QuantizedWeights (kernel_backends/quantized_weight.py), never as floats, and
run them through the KernelBackend (``quantized_linear``, ``quantized_embedding``).

They are swapped in while the model is still on the meta device (``swap_quantized``), so
no float copy of a quantized weight is ever allocated. QuantizedWeights are plain
attributes, not parameters or buffers: ``to_empty`` and ``.to(dtype)`` leave them alone
(their scales stay float32); only a bias is a parameter, served in the model's dtype.

A fused linear (q/k/v, gate/up) holds one weight per checkpoint tensor, each for its rows
of the output (a Q4_K_M file mixes Q4_K and Q6_K among them); the outputs are concatenated.
A slice the file keeps in floats is a child ``nn.Linear`` (no bias: the module adds its
bias slice), so that the backend's ``prepare_model`` serves it as it serves every float
linear of the decoder (the CPU backend packs it: in its batch-invariant layout where
--batch-invariant is on, docs/sampling.md).
LoRA wraps a QuantizedLinear as it wraps an ``nn.Linear`` (it reads ``in_features`` and
calls ``base(x)``).

A weight with an ``input_perm`` (a GPTQ act-order checkpoint, its columns sorted by group:
engine/models/gptq_awq.py) is multiplied by ``x[..., input_perm]``, gathered here before
the backend's kernel (so every backend serves it) once per distinct perm of a forward:
parts with equal perms share one tensor (``set_rows``). The LoRA wrapper hands the
unpermuted x to both this module and its adapters.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ...kernel_backends.backend import KernelBackend
from ...kernel_backends.quantized_weight import QuantizedWeight

# a part: a quantized weight, or the name of the child linear holding a float slice (the
# name, not the module: prepare_model may replace the child by a packed one)
Part = QuantizedWeight | str


class QuantizedLinear(nn.Module):
    """``y = x Wᵀ + b`` with W ``[out_features, in_features]`` stored quantized, in row
    ranges (``set_rows``) that together cover every output row once. A range may be a float
    tensor (a GGUF file may keep one slice of a fused linear in F16 / F32): it is held in
    the serving dtype by a child linear (``float_rows_<first row>``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: KernelBackend):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.ops = ops
        self.parts: list[tuple[int, Part]] = []  # (first row, weight), by row
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def like(cls, linear: nn.Linear, ops: KernelBackend) -> QuantizedLinear:
        return cls(linear.in_features, linear.out_features, linear.bias is not None, ops)

    def set_rows(self, rows: slice | None, weight: Part) -> None:
        """``weight`` serves output rows ``rows`` (None: all of them)."""
        start, stop = (0, self.out_features) if rows is None else (rows.start, rows.stop)
        if tuple(weight.shape) != (stop - start, self.in_features):
            raise ValueError(f"a weight {tuple(weight.shape)} for rows [{start}, {stop}) "
                             f"of a linear [{self.out_features}, {self.in_features}]")
        for first, old in self.parts:
            if first == start and isinstance(old, str):
                delattr(self, old)
        part: Part
        if isinstance(weight, torch.Tensor):
            part = f"float_rows_{start}"
            linear = nn.Linear(self.in_features, stop - start, bias=False,
                               device=self.ops.device, dtype=self.ops.dtype)
            linear.weight = nn.Parameter(
                weight.to(self.ops.device, self.ops.dtype).contiguous(), requires_grad=False)
            self.add_module(part, linear)
        else:  # a checkpoint's weights are read on the CPU (GPTQ / AWQ repacked there)
            part = weight.to(self.ops.device)
            if part.input_perm is not None:
                part = self._share_perm(part)
        self.parts = sorted([p for p in self.parts if p[0] != start] + [(start, part)],
                            key=lambda p: p[0])

    def merge_parts(self) -> None:
        """Adjacent parts of one generic format (int8, int4: quantized on load, or a GPTQ /
        AWQ checkpoint repacked) with the same input_perm become one weight, their rows
        concatenated: one kernel call and no concatenation of outputs a forward (each
        output row's result is the same bits: the kernels compute rows apart). GGUF parts
        stay apart: they are views of the mapped file, and a copy would hold their bytes
        twice; forward runs them in one call all the same (quantized_linear_parts)."""
        merged: list[tuple[int, Part]] = []
        for start, part in self.parts:
            last = merged[-1][1] if merged else None
            if _mergeable(last, part):
                merged[-1] = (merged[-1][0], _concat_rows(last, part))
            else:
                merged.append((start, part))
        self.parts = merged

    def _rows(self, part: Part) -> int:
        """How many output rows ``part`` serves."""
        return getattr(self, part).out_features if isinstance(part, str) else part.shape[0]

    def complete(self) -> bool:
        """Whether the parts cover the output rows exactly, in order."""
        row = 0
        for start, part in self.parts:
            if start != row:
                return False
            row += self._rows(part)
        return row == self.out_features

    def _share_perm(self, weight: QuantizedWeight) -> QuantizedWeight:
        """``weight`` with its input_perm the very tensor of another part's when equal
        (q/k/v, gate/up read one x: one gather serves them all)."""
        for _, other in self.parts:
            theirs = getattr(other, "input_perm", None)
            if theirs is not None and torch.equal(theirs, weight.input_perm):
                return dataclasses.replace(weight, input_perm=theirs)
        return weight

    def _run(self, x: torch.Tensor, weight: Part, bias: torch.Tensor | None,
             gathered: dict[int, torch.Tensor]) -> torch.Tensor:
        if isinstance(weight, str):  # a float slice: the child linear, then its bias
            y = getattr(self, weight)(x)
            return y if bias is None else y + bias
        perm = weight.input_perm
        if perm is not None:  # the stored columns are the inputs in perm's order
            if id(perm) not in gathered:
                gathered[id(perm)] = x.index_select(-1, perm)
            x = gathered[id(perm)]
        return self.ops.quantized_linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered: dict[int, torch.Tensor] = {}  # id(input_perm) -> x[..., input_perm]
        if len(self.parts) == 1:
            return self._run(x, self.parts[0][1], self.bias, gathered)
        weights = [w for _, w in self.parts]
        if all(isinstance(w, QuantizedWeight) and w.input_perm is weights[0].input_perm
               for w in weights):  # e.g. a GGUF's q, k, v: one call over the parts
            perm = weights[0].input_perm
            return self.ops.quantized_linear_parts(
                x if perm is None else x.index_select(-1, perm), weights, self.bias)
        outs = []
        for start, weight in self.parts:
            bias = None if self.bias is None else self.bias[start:start + self._rows(weight)]
            outs.append(self._run(x, weight, bias, gathered))
        return torch.cat(outs, dim=-1)

    @property
    def weights(self) -> list[QuantizedWeight]:
        """The quantized parts' weights."""
        return [w for _, w in self.parts if isinstance(w, QuantizedWeight)]

    @property
    def float_bytes(self) -> int:
        """The bytes of the float parts."""
        return sum(self._rows(p) * self.in_features * self.ops.dtype.itemsize
                   for _, p in self.parts if isinstance(p, str))

    def extra_repr(self) -> str:
        formats = "+".join(dict.fromkeys(
            w.format.name if isinstance(w, QuantizedWeight) else str(self.ops.dtype)
            for _, w in self.parts))
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={formats or 'unset'}")


def _mergeable(a: Part | None, b: Part) -> bool:
    return (isinstance(a, QuantizedWeight) and isinstance(b, QuantizedWeight)
            and not a.format.is_gguf and a.format == b.format and a.input_perm is b.input_perm
            and (a.scales is None) == (b.scales is None)
            and (a.scales is None or a.scales.dtype == b.scales.dtype))


def _concat_rows(a: QuantizedWeight, b: QuantizedWeight) -> QuantizedWeight:
    def cat(x: torch.Tensor | None, y: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else torch.cat([x, y])

    return dataclasses.replace(a, shape=(a.shape[0] + b.shape[0], a.shape[1]),
                               data=cat(a.data, b.data), scales=cat(a.scales, b.scales),
                               zeros=cat(a.zeros, b.zeros))


def merge_parts(model: nn.Module) -> None:
    """QuantizedLinear.merge_parts on every quantized linear of ``model`` (once loaded)."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.merge_parts()


class QuantizedEmbedding(nn.Module):
    """A token embedding ``[num_embeddings, embedding_dim]`` stored quantized: a lookup
    dequantizes the looked-up rows only, in the serving dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int, ops: KernelBackend):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.ops = ops
        self.qweight: QuantizedWeight | None = None

    def set_weight(self, weight: QuantizedWeight) -> None:
        if weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"a quantized embedding {weight.shape} for a table "
                             f"[{self.num_embeddings}, {self.embedding_dim}]")
        self.qweight = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.quantized_embedding(input_ids, self.qweight)

    @property
    def weights(self) -> list[QuantizedWeight]:
        return [] if self.qweight is None else [self.qweight]

    def extra_repr(self) -> str:
        fmt = self.qweight.format.name if self.qweight is not None else "unset"
        return f"{self.num_embeddings}, {self.embedding_dim}, format={fmt}"


def tied_head(embedding: QuantizedEmbedding) -> QuantizedLinear:
    """The logits head tied to a quantized embedding: the same QuantizedWeight (no copy)."""
    head = QuantizedLinear(embedding.embedding_dim, embedding.num_embeddings, False,
                           embedding.ops)
    head.set_rows(None, embedding.qweight)
    return head


def attach_quantized_head(model: nn.Module) -> None:
    """A quantized head becomes the model's ``logits_head``: the tied one (a QuantizedLinear
    over the quantized embedding's weight) or a quantized ``lm_head``. A float head is left
    to the model (and to the backend's ``prepare_model``)."""
    embed = model.model.embed_tokens
    if model.tie_word_embeddings and isinstance(embed, QuantizedEmbedding):
        model.logits_head = tied_head(embed)
    elif not model.tie_word_embeddings and isinstance(model.lm_head, QuantizedLinear):
        model.logits_head = model.lm_head


def swap_quantized(model: nn.Module, module_names: set[str], ops: KernelBackend) -> None:
    """Replace each ``nn.Linear`` / ``nn.Embedding`` named in ``module_names`` (dotted paths
    from ``model``) by its quantized counterpart; the model is on meta, so nothing is
    allocated but the biases' placeholders."""
    for name in sorted(module_names):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        child = getattr(parent, attr)
        if type(child) is nn.Linear:
            setattr(parent, attr, QuantizedLinear.like(child, ops))
        elif type(child) is nn.Embedding:
            setattr(parent, attr, QuantizedEmbedding(child.num_embeddings, child.embedding_dim,
                                                     ops))
        else:
            raise TypeError(f"{name} is a {type(child).__name__}; only linears and the "
                            f"embedding are served quantized")


def check_complete(model: nn.Module, where: str) -> None:
    """ValueError naming the quantized modules some of whose rows no tensor filled."""
    missing = [name for name, m in model.named_modules()
               if (isinstance(m, QuantizedLinear) and not m.complete())
               or (isinstance(m, QuantizedEmbedding) and m.qweight is None)]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"quantized weights missing from {where}: {missing[:5]}{more}")


@dataclass(frozen=True)
class WeightsInfo:
    """What the served weights are: ``format`` ("float" when nothing is quantized, else the
    quantized formats by weights held, e.g. "Q4_1+Q8_0"; a GPTQ / AWQ checkpoint's
    prefixed by its method: "gptq:int4"), the float ``dtype`` everything
    else is served in, the average ``bits`` a quantized weight takes (0 when none is) and
    the ``bytes`` of every weight of the model (quantized and float, each counted once)."""

    format: str
    dtype: str
    bits: float
    bytes: int
    quantized_bytes: int

    def describe(self) -> str:
        if self.format == "float":
            return f"{self.dtype} weights, {self.bytes / 2**20:.1f} MiB"
        return (f"{self.format} weights ({self.bits:.2f} bits a weight, "
                f"{self.quantized_bytes / 2**20:.1f} MiB) and {self.dtype} for the rest, "
                f"{self.bytes / 2**20:.1f} MiB in all")

    def as_dict(self) -> dict:
        return {"format": self.format, "dtype": self.dtype, "bits": round(self.bits, 3),
                "bytes": self.bytes}


def weights_info(model: nn.Module, dtype: torch.dtype, source: str = "") -> WeightsInfo:
    """The WeightsInfo of ``model`` served in ``dtype``; ``source`` (the checkpoint's
    quant_method, "gptq" or "awq") prefixes the format: "gptq:int4"."""
    seen: set[int] = set()
    formats: Counter[str] = Counter()
    qbytes, qweights = 0, 0
    for module in model.modules():
        for w in getattr(module, "weights", []) if isinstance(
                module, (QuantizedLinear, QuantizedEmbedding)) else []:
            if id(w) in seen:
                continue
            seen.add(id(w))
            n = w.shape[0] * w.shape[1]
            formats[w.format.name] += n
            qbytes += w.nbytes
            qweights += n
    # the float parameters: a QuantizedLinear's float slices among them (child linears)
    float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    name = "+".join(f for f, _ in formats.most_common()) or "float"
    if source and formats:
        name = f"{source}:{name}"
    bits = qbytes * 8 / qweights if qweights else 0.0
    return WeightsInfo(name, str(dtype).removeprefix("torch."), bits, qbytes + float_bytes,
                       qbytes)
