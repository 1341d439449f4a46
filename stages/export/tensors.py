"""The bytes of one planned tensor (`plan.TensorPlan`), made from the artifact's state dict when it is written,
so the export holds one tensor at a time beside the memory-mapped artifact."""
from __future__ import annotations

import numpy as np
import torch

from ..compressed import LinearScheme, decompress_linear, dequantize_codes
from .blocks import llama_rows, pack_blocks
from .plan import DENSE, EXACT, TensorPlan


def tensor_data(plan: TensorPlan, state: dict, schemes: dict[str, LinearScheme]) -> np.ndarray:
    """The array GGUFWriter writes for `plan`: uint8 blocks for a block type and BF16, float32 / float16 else."""
    if plan.how == DENSE:
        return _dense(_rows(state[plan.name], plan.heads), plan.qtype)
    scheme = schemes[plan.module]
    q, scale, zero = decompress_linear(state, plan.module, scheme)  # [out, in], [out, groups], [out, groups]
    q, scale = _rows(q, plan.heads), _rows(scale, plan.heads)
    if plan.how == EXACT or plan.keep_codes:
        return pack_blocks(q, scale, scheme.bits)
    zero = None if zero is None else _rows(zero, plan.heads)
    return _requantize(dequantize_codes(q, scale, zero, torch.float32), plan.qtype)


def _rows(t: torch.Tensor, heads: int | None) -> torch.Tensor:
    return t if heads is None else llama_rows(t, heads)


def _dense(t: torch.Tensor, qtype: str) -> np.ndarray:
    if qtype == "F32":
        return t.float().contiguous().numpy()
    if qtype == "F16":
        return t.contiguous().numpy()
    return t.contiguous().view(torch.uint8).numpy()  # BF16: its bytes, [rows, cols * 2]


def _requantize(w: torch.Tensor, qtype: str) -> np.ndarray:
    """The dequantized weights w (fp32) as `qtype`, by gguf's quantizer (llama.cpp's reference rounding)."""
    import gguf

    return gguf.quants.quantize(w.contiguous().numpy(), gguf.GGMLQuantizationType[qtype])

