"""Which GGUF type each tensor of an artifact becomes, decided before a byte is written.

- A quantized tensor whose codes and scales fill GGUF blocks as they are (symmetric int4 / int8 in groups of 32
  with fp16 scales: Q4_0 / Q8_0) is re-packed: `exact`.
- Any other quantized tensor (other group sizes, asymmetric, W8A8's per-channel int8, scales that are not fp16
  numbers) is refused, naming the tensor and why, unless --allow-requantize names a type: then it is
  `requantized` to that type. Where only the scales' precision stood in the way and the named type is the
  tensor's own, the codes are kept and the scales rounded to fp16; otherwise the artifact's dequantized
  weights are quantized by gguf's own quantizer.
- A dense tensor is written as it is stored (`dense`): 1-D ones (norms, biases) as F32, as llama.cpp wants
  them, 2-D ones as F32, F16 or BF16 after their dtype, so no value changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compressed import LinearScheme
from ..errors import ConfigError
from .blocks import BLOCK, fp16_exact

EXACT, REQUANTIZED, DENSE, REFUSED = "exact", "requantized", "dense", "refused"
NATURAL = {4: "Q4_0", 8: "Q8_0"}  # bits of a symmetric group-32 code -> the GGUF type that holds it exactly
KEEP_CODES = "codes kept, scales rounded to fp16"  # the tensor's own type; only its scales' precision differed
FROM_WEIGHTS = "gguf's quantizer on the dequantized weights"
DENSE_TYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the GGUF file: where it comes from, what it becomes, and why."""

    name: str  # ours: model.layers.0.self_attn.q_proj.weight
    gguf_name: str  # llama.cpp's: blk.0.attn_q.weight
    shape: tuple[int, ...]  # [rows, cols] or [n], as the weight is used
    qtype: str  # a GGMLQuantizationType name: Q4_0, Q8_0, F32, ...
    how: str  # EXACT | REQUANTIZED | DENSE | REFUSED (needs re-quantizing, which --allow-requantize did not allow)
    stored: str  # what the artifact holds: "int4 group 32 symmetric", "bf16"
    why: str = ""  # REQUANTIZED, REFUSED: why no GGUF type holds it exactly
    method: str = ""  # REQUANTIZED: KEEP_CODES or FROM_WEIGHTS
    module: str | None = None  # the quantized module (its scheme is looked up under this name)
    heads: int | None = None  # llama.cpp's query/key row order over this many heads (None: rows as stored)

    @property
    def keep_codes(self) -> bool:
        return self.method == KEEP_CODES

    @property
    def nbytes(self) -> int:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.qtype]]
        rows = 1
        for n in self.shape[:-1]:
            rows *= n
        return rows * self.shape[-1] // block * size

    def record(self) -> dict:
        return {"name": self.name, "gguf_name": self.gguf_name, "shape": list(self.shape), "type": self.qtype,
                "how": self.how, "stored": self.stored, **({"why": self.why} if self.why else {}),
                **({"method": self.method} if self.method else {})}


def scheme_text(scheme: LinearScheme, width: int) -> str:
    if scheme.activations:
        return "W8A8 int8 per output channel"
    return f"int{scheme.bits} group {width} {'symmetric' if scheme.symmetric else 'asymmetric'}"


def obstacle(scheme: LinearScheme, width: int, scale: torch.Tensor) -> str | None:
    """Why the codes and scales of a quantized tensor fill no GGUF blocks exactly (None: they fill NATURAL's)."""
    if scheme.activations:
        return "W8A8 (int8 per output channel, int8 activations at run time) has no exact GGUF type"
    if scheme.bits not in NATURAL:
        return f"int{scheme.bits} has no exact GGUF type (Q4_0 holds int4, Q8_0 int8)"
    if not scheme.symmetric:
        return f"asymmetric int{scheme.bits} has no exact GGUF type (Q4_0 and Q8_0 are symmetric)"
    if width != BLOCK:
        return f"int{scheme.bits} group {width} has no exact GGUF type (Q4_0 and Q8_0 take groups of {BLOCK})"
    if not fp16_exact(scale):
        dtype = str(scale.dtype).removeprefix("torch.")
        return (f"its {dtype} scales are not all fp16 numbers (GGUF keeps an fp16 scale per block; quantize "
                "with --dtype bf16 or fp16 for an exact export)")
    return None


def plan_quantized(name: str, gguf_name: str, module: str, scheme: LinearScheme, shape: tuple[int, int],
                   scale: torch.Tensor, allow: str | None, heads: int | None) -> TensorPlan:
    """The plan of a quantized tensor: EXACT, REQUANTIZED to `allow`, or (`allow` None) REFUSED, for the caller
    to refuse every such tensor in one line (`refuse`)."""
    width = shape[1] // scale.shape[1] if scale.dim() == 2 and scale.shape[1] else shape[1]
    stored = scheme_text(scheme, width)
    why = obstacle(scheme, width, scale)
    base = dict(name=name, gguf_name=gguf_name, shape=tuple(shape), stored=stored, module=module, heads=heads)
    if why is None:
        return TensorPlan(qtype=NATURAL[scheme.bits], how=EXACT, **base)
    if allow is None:
        return TensorPlan(qtype="F32", how=REFUSED, why=why, **base)
    qtype = allow.upper()
    keep = (scheme.symmetric and not scheme.activations and width == BLOCK and NATURAL.get(scheme.bits) == qtype
            and bool(torch.isfinite(scale.to(torch.float16)).all()))
    check_rows(name, shape, qtype)
    return TensorPlan(qtype=qtype, how=REQUANTIZED, why=why, method=KEEP_CODES if keep else FROM_WEIGHTS, **base)


def check_rows(name: str, shape: tuple[int, ...], qtype: str) -> None:
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    if shape[-1] % block:
        raise ConfigError(f"export: {name}: rows of {shape[-1]} do not split into {qtype} blocks of {block}; "
                          "choose another --allow-requantize type")


def plan_dense(name: str, gguf_name: str, tensor: torch.Tensor, heads: int | None) -> TensorPlan:
    if tensor.dtype not in DENSE_TYPES or tensor.dim() not in (1, 2):
        raise ConfigError(f"export: {name} is {tensor.dtype} {tuple(tensor.shape)}; GGUF export writes 1-D and "
                          "2-D float tensors and compressed-tensors codes")
    qtype = "F32" if tensor.dim() == 1 else DENSE_TYPES[tensor.dtype]
    return TensorPlan(name=name, gguf_name=gguf_name, shape=tuple(tensor.shape), qtype=qtype, how=DENSE,
                      stored=str(tensor.dtype).removeprefix("torch."), heads=heads)


def refuse(plans: list[TensorPlan]) -> None:
    """ConfigError, one line, when some tensor needs re-quantizing: the first named, with its reason, and a count."""
    refused = [p for p in plans if p.how == REFUSED]
    if not refused:
        return
    first, more = refused[0], len(refused) - 1
    others = f" (and {more} more tensor{'s' if more > 1 else ''})" if more else ""
    raise ConfigError(f"export: {first.module} ({first.gguf_name}): {first.why}; pass --allow-requantize TYPE "
                      f"(q8_0, q4_0, ...) to re-quantize it{others}")


def file_order(plan: TensorPlan) -> tuple:
    """llama.cpp's own order of tensors in a file: token_embd, the blocks in order, output_norm, output."""
    name = plan.gguf_name
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return ({"token_embd": 0, "output_norm": 2, "output": 3}.get(name.split(".")[0], 4), 0, name)
