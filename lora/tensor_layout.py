"""TensorLayout: where an adapter's A and B tensors lie in its safetensors file, and how they
become the A and scaled B the engine holds (float32, or the dtype of the engine's pool).

It is built from the header alone (``peft_format.inspect_peft_adapter``); ``load`` then costs
about what the bytes cost: one read of the file's data section into a buffer of its own, one
conversion to float32 when the file holds one dtype (the usual case; a file that mixes dtypes
is converted tensor by tensor), A and B as views of that buffer, one sum to check that every
value is finite (only a non-finite sum looks further, to name the tensor), the B views
multiplied by their scaling in place (one call), and, for another held dtype, one
conversion of the buffer (the scaling is applied in float32 first, so the values held are
float32's rounded once: what copying float32 into that pool would give). lora_B's biases
(``lora_bias=True``) are read the same way and scaled with their B (``load_all``); DoRA's
magnitude vectors (``use_dora=True``) are read the same way, not scaled, and held in
float32 whatever the held dtype (``load_all``).
"""

from __future__ import annotations

import math
import os
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .adapter_files import AdapterFiles, real_path
from .peft_checks import AdapterError, Plan, TensorKeys, scaling
from .peft_files import ITEMSIZE, WEIGHTS_NAME, ContentKey, SafetensorsHeader, content_key

Pair = tuple[int, str]  # (layer, module)
Layers = dict[Pair, tuple[torch.Tensor, torch.Tensor]]  # -> (A [r, in], B [out, r])
Biases = dict[Pair, torch.Tensor]  # -> lora_B's bias [out] (lora_bias), scaled like B
Magnitudes = dict[Pair, torch.Tensor]  # -> DoRA's magnitude [out] (use_dora), float32

_PAIRS: dict[Pair, Pair] = {}  # one tuple per (layer, module) seen, held by every layout
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E5M2": torch.float8_e5m2}  # peft_checks.FLOAT_DTYPES


@dataclass(frozen=True)
class TensorLayout:
    """Per (layer, module), in sorted order: rank, where A and B start (bytes after
    ``data_start``) and B's scaling. Shapes follow: A [r, in], B [out, r] with the base's
    (in, out) of the module (``dims``)."""

    ranks: dict[Pair, int]  # sorted by pair; the order of the arrays below
    dims: dict[str, tuple[int, int]]  # module -> (in, out) of the base
    a_at: array  # 'q', per pair
    b_at: array  # 'q', per pair
    scales: array  # 'd', per pair
    dtypes: tuple[str, ...]  # the file's one dtype, or (A's, B's[, bias's][, magnitude's])
    # of every pair
    data_start: int
    data_bytes: int
    header: ContentKey  # of the header this layout was built from
    bias_at: array = field(default_factory=lambda: array("q"))  # 'q', per pair (-1: none);
    # empty when no pair has a bias
    mag_at: array = field(default_factory=lambda: array("q"))  # 'q', per pair: DoRA's
    # magnitude vector; empty for an adapter without DoRA (with it, every pair has one)

    @classmethod
    def of(cls, header: SafetensorsHeader, keys: TensorKeys, plan: Plan,
           dims: dict[str, tuple[int, int]], use_rslora: bool) -> TensorLayout:
        """The layout of checked tensors: ``keys`` index ``header`` (dtypes floating) and
        every pair is in ``plan``."""
        at, offset = {}, 0
        for name, (dtype, shape) in header.tensors.items():  # back to back, in file order
            at[name] = offset
            offset += ITEMSIZE[dtype] * math.prod(shape)
        pairs = [_PAIRS.setdefault(p, p) for p in sorted(keys)]  # shared by every adapter
        per_tensor = [header.tensors[keys[p][h]][0] for p in pairs for h in "ABbm"
                      if h in keys[p]]
        biased = any("b" in keys[p] for p in pairs)
        dora = any("m" in keys[p] for p in pairs)
        return cls(
            ranks={p: plan[p][0] for p in pairs}, dims=dims,
            a_at=array("q", [at[keys[p]["A"]] for p in pairs]),
            b_at=array("q", [at[keys[p]["B"]] for p in pairs]),
            scales=array("d", [scaling(*plan[p], use_rslora) for p in pairs]),
            dtypes=tuple(per_tensor) if len(set(per_tensor)) > 1 else (per_tensor[0],),
            data_start=header.data_start, data_bytes=offset, header=header.key,
            bias_at=array("q", [at[keys[p]["b"]] if "b" in keys[p] else -1 for p in pairs]
                          if biased else []),
            mag_at=array("q", [at[keys[p]["m"]] for p in pairs] if dora else []))

    def held_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of A and B (and lora_B's biases) as ``load_all`` returns them in ``dtype``,
        and of DoRA's magnitudes (float32)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        biases = sum(self.dims[m][1] for ((_, m), at) in zip(self.ranks, self.bias_at)
                     if at >= 0)
        magnitudes = sum(self.dims[m][1] for (_, m) in self.ranks) if self.mag_at else 0
        return itemsize * (sum(r * sum(self.dims[m]) for (_, m), r in self.ranks.items())
                           + biases) + 4 * magnitudes

    def load(self, files: AdapterFiles, names: Callable[[], TensorKeys],
             dtype: torch.dtype = torch.float32) -> Layers:
        """A and B as ``load_all`` reads them (without lora_B's biases)."""
        return self.load_all(files, names, dtype)[0]

    def load_all(self, files: AdapterFiles, names: Callable[[], TensorKeys],
                 dtype: torch.dtype = torch.float32) -> tuple[Layers, Biases, Magnitudes]:
        """Read A and B and lora_B's biases (B scaled in float32, both then held in ``dtype``)
        and DoRA's magnitudes (float32) from the
        adapter's safetensors file (opened confined: ``files.open``); ``names`` gives the
        tensor names for an error message. StaleLayout if the file's header is no longer
        the one this layout was built from."""
        path = files.label(WEIGHTS_NAME)  # what messages call the file
        raw = self._read(files)  # [data_bytes] uint8, our own memory
        if len(self.dtypes) == 1:
            stored = TORCH_DTYPES[self.dtypes[0]]
            # scaled in the stored dtype when it is the one held (torch multiplies a half
            # tensor in float32 and rounds once: the same bits), else in float32
            flat = raw.view(stored).to(stored if stored == dtype else torch.float32)
            size = ITEMSIZE[self.dtypes[0]]
            layers, biases = self._views(flat, size)
            magnitudes = {pair: flat.as_strided((self.dims[pair[1]][1],), (1,), at // size)
                          .to(torch.float32, copy=True)
                          for pair, at in zip(self.ranks, self.mag_at)}
        else:
            flat, size, (layers, biases, magnitudes) = None, 0, self._convert_each(raw)
        if not torch.isfinite(flat.sum(dtype=torch.float32) if flat is not None else  # one pass
                              torch.stack([t.sum() for ab in layers.values() for t in ab]
                                          + [t.sum() for t in biases.values()]
                                          + [t.sum() for t in magnitudes.values()]).sum()):
            self._name_nonfinite(layers, biases, path, names)
            self._name_nonfinite({}, magnitudes, path, names, vectors="m")
        if any(s != 1.0 for s in self.scales):
            torch._foreach_mul_([b for _, b in layers.values()], list(self.scales))
            if biases:
                scale = dict(zip(self.ranks, self.scales))
                torch._foreach_mul_(list(biases.values()), [scale[p] for p in biases])
        if flat is not None:
            return (*((layers, biases) if flat.dtype == dtype
                      else self._views(flat.to(dtype), size)), magnitudes)
        return ({pair: (a.to(dtype), b.to(dtype)) for pair, (a, b) in layers.items()},
                {pair: b.to(dtype) for pair, b in biases.items()}, magnitudes)

    def _views(self, flat: torch.Tensor, size: int) -> tuple[Layers, Biases]:
        """A and B (and biases) as views of ``flat``, the data section as one tensor of a
        dtype whose file item size is ``size`` (tensor offsets are in bytes of the file)."""
        layers, biases = {}, {}
        for (pair, r), a_at, b_at in zip(self.ranks.items(), self.a_at, self.b_at):
            d_in, d_out = self.dims[pair[1]]
            layers[pair] = (flat.as_strided((r, d_in), (d_in, 1), a_at // size),
                            flat.as_strided((d_out, r), (r, 1), b_at // size))
        for pair, at in zip(self.ranks, self.bias_at):
            if at >= 0:
                biases[pair] = flat.as_strided((self.dims[pair[1]][1],), (1,), at // size)
        return layers, biases

    def _read(self, files: AdapterFiles) -> torch.Tensor:
        """The data section, from the same open file as the header it is checked against."""
        raw = torch.empty(self.data_bytes, dtype=torch.uint8)
        path = files.label(WEIGHTS_NAME)
        with files.open(WEIGHTS_NAME) as f:
            head = f.read(self.data_start)
            real = real_path(f, files.dir / WEIGHTS_NAME)
            if content_key(real, os.fstat(f.fileno()).st_size, head) != self.header:
                raise StaleLayout(f"{path} changed since it was inspected")
            done = f.readinto(memoryview(raw.numpy()))  # a buffered read: all, or up to EOF
        if done != self.data_bytes:
            raise AdapterError(f"{path} is not a readable safetensors file (truncated or "
                               f"corrupt?): {done} of {self.data_bytes} data bytes")
        return raw

    def _convert_each(self, raw: torch.Tensor) -> tuple[Layers, Biases, Magnitudes]:
        """A file that mixes dtypes: each tensor from its bytes to its own float32 tensor."""
        layers, biases, magnitudes, dtypes = {}, {}, {}, iter(self.dtypes)
        bias_at = self.bias_at or array("q", [-1] * len(self.ranks))
        mag_at = self.mag_at or array("q", [-1] * len(self.ranks))
        for (pair, r), a_at, b_at, c_at, m_at in zip(self.ranks.items(), self.a_at, self.b_at,
                                                     bias_at, mag_at):
            d_in, d_out = self.dims[pair[1]]
            a = _tensor(raw, a_at, next(dtypes), (r, d_in))
            layers[pair] = (a, _tensor(raw, b_at, next(dtypes), (d_out, r)))
            if c_at >= 0:
                biases[pair] = _tensor(raw, c_at, next(dtypes), (d_out, 1)).view(d_out)
            if m_at >= 0:
                magnitudes[pair] = _tensor(raw, m_at, next(dtypes), (d_out, 1)).view(d_out)
        return layers, biases, magnitudes

    @staticmethod
    def _name_nonfinite(layers: Layers, biases: Biases, path: str,
                        names: Callable[[], TensorKeys], vectors: str = "b") -> None:
        """AdapterError naming the first tensor with a NaN or Inf (a sum can also overflow
        to Inf on finite values: then there is none, and nothing is raised)."""
        for pair, ab in layers.items():
            for half, t in zip("AB", ab):
                if not torch.isfinite(t).all():
                    raise AdapterError(f"{path}: tensor {names()[pair][half]!r} holds NaN or "
                                       "Inf values; all LoRA weights must be finite")
        for pair, vector in biases.items():  # lora_B's biases, or (vectors "m") magnitudes
            if not torch.isfinite(vector).all():
                raise AdapterError(f"{path}: tensor {names()[pair][vectors]!r} holds NaN or "
                                   "Inf values; all LoRA weights must be finite")


class StaleLayout(AdapterError):
    """The file changed after inspection: inspect it again."""


def _tensor(raw: torch.Tensor, at: int, dtype: str, shape: tuple[int, int]) -> torch.Tensor:
    """float32 copy of the tensor at byte ``at`` of ``raw``."""
    src = raw[at: at + ITEMSIZE[dtype] * shape[0] * shape[1]]
    if at % ITEMSIZE[dtype]:  # an odd offset after a narrower dtype: views need alignment
        src = src.clone()
    return src.view(TORCH_DTYPES[dtype]).view(shape).to(torch.float32, copy=True)
