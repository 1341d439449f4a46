"""CPU matmul kernels of the dense projections and their policy: the native GEMV wrapper, oneDNN on row
buckets, and the prebuild of oneDNN's per-shape primitives.

Measured here (30 layers of SmolLM2 shapes + lm_head, weights streamed from memory, 2 threads):
- decode-sized calls (up to `cpu_native.GEMV_MAX_ROWS` rows): the native GEMV on a tiled copy streams the
  weight at 25-28 GB/s where torch's default F.linear (MKL) reached a third of the machine's read bandwidth
  (fp32, batch 1: 21 ms for the model's weights vs 28 ms oneDNN, 35 ms MKL);
- more rows: oneDNN on a reordered weight (1.2-2x faster than MKL at 2+ rows in fp32 and at every batch
  size in bf16);
- without the native library, fp32 with one row: MKL on the transposed weight [K, N].
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_native
from .layout_cache import cached_layout
from .linear import RoutedLinear

ROW_CHUNK = 512  # rows per oneDNN call beyond this; larger calls were no faster per row here
PACK_BATCH = 8  # oneDNN's batch hint for the reorder; 8 measured as fast as 1 at batch 1
_GEMVS = {cpu_native.DenseWeight: cpu_native.gemv, cpu_native.Int4Weight: cpu_native.gemv_w4,
          cpu_native.Int8Weight: cpu_native.gemv_w8}


class NativeLinear:
    """A projection's native GEMV (csrc/gemv.c): its weight in the tiled layout, the fp32 bias the GEMV adds,
    and the most rows the backend sends it. Callable on x [M, K]; `desc()` describes it for the fused step."""

    def __init__(self, weight, bias: torch.Tensor | None, max_rows: int):
        self.weight, self.max_rows = weight, max_rows
        self.bias = None if bias is None else bias.float().contiguous()
        self.gemv = _GEMVS[type(weight)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemv(x if x.stride(1) == 1 else x.contiguous(), self.weight, self.bias)

    def desc(self):
        """(C description, tensors it points into) for `cpu_native.DecodeLayers`."""
        return cpu_native.linear_desc(self.weight, self.bias), [self.weight, self.bias]


class DenseLinear(RoutedLinear):
    """`x @ weight.T + bias` on a plain (possibly fused) weight [N, K], on the CPU kernels its backend chose.

    `prepare(native)` converts the weight once: a oneDNN-reordered copy for most calls, and either the native
    GEMV's tiled copy for decode-sized calls (`native=True`; the loaded weight is then released) or, in
    fp32, the transposed weight for single rows (MKL). Weights oneDNN cannot take stay on F.linear.
    `prepare(native, above_rows=R)`: the layer only ever takes calls of more than R rows (a quantized layer's
    dequantized copy beyond its GEMV's rows), so oneDNN's copy is all it keeps.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.shape[1], weight.shape[0])
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.packed = self.weight_t = self.native = None  # CPU layouts, set by prepare()
        self.released: tuple[str, ...] = ()  # buffers left on the meta device once their layouts exist
        self.fewest_rows = 1  # the fewest rows a call brings (`prepare(above_rows=...)`)
        self.route(self._plain)

    def prepare(self, native: bool, above_rows: int = 0) -> "DenseLinear":
        """Make the CPU layouts and route to them (see the class docstring); returns self."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) \
                or not torch.backends.mkldnn.is_available() or not onednn_takes(w.dtype):
            return self
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_BATCH)
        if above_rows > 0:  # neither a GEMV nor MKL's single row: nothing but oneDNN reads the weight
            self.fewest_rows = above_rows + 1
            return self._release().route(self._onednn)
        if native:
            tiled = cached_layout("native", lambda: cpu_native.DenseWeight(w))
            self.native = NativeLinear(tiled, self.bias, cpu_native.GEMV_MAX_ROWS[w.dtype])
            # Both CPU paths now hold their own copy: the loaded one goes (one model's worth of memory; a tied
            # lm_head's stays alive as the embedding).
            return self._release().route(self._onednn, self.native, self.native.max_rows)
        if w.dtype == torch.float32:
            self.weight_t = w.t().contiguous()  # [K, N]
            self.weight = self.weight_t.t()  # a view: an unshared fused copy is freed
            return self.route(self._onednn, self._mkl_row, 1)
        return self.route(self._onednn)

    def _release(self) -> "DenseLinear":
        """Free the loaded weight once the layouts the calls read exist; its shape and dtype remain, on the
        meta device."""
        self.weight = self.weight.to("meta")
        self.released = ("weight",)
        return self

    def _plain(self, x):
        return F.linear(x, self.weight, self.bias)

    def _mkl_row(self, x):
        y = torch.mm(x, self.weight_t)  # [1, N]
        return y if self.bias is None else y.add_(self.bias)

    def _onednn(self, x):
        return on_row_buckets(self._onednn_call, x)

    def _onednn_call(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")


def row_bucket(rows: int) -> int:
    """The row count a CPU matmul of `rows` rows is padded to: exact up to 16; then eight steps per
    power of two up to 64 (17..32 by 2, 33..64 by 4: decode batches, at most 12.5% padding); beyond,
    four (65..128 by 16, ...: mostly prefill chunks, at most 25%), so that the rarely seen large
    shapes are few and all seen early."""
    if rows <= 16:
        return rows
    bits = (rows - 1).bit_length()
    step = 1 << (bits - (4 if bits <= 6 else 3))
    return -(-rows // step) * step


def on_row_buckets(matmul, x: torch.Tensor) -> torch.Tensor:
    """`matmul(x)` for x [M, K], called only on row counts from a small fixed set.

    oneDNN builds and caches a primitive per input shape, each holding from a few hundred KiB to
    over 1 MiB (measured: 1,600 distinct row counts on SmolLM2's four projection shapes took 1.36 GiB,
    and once its 1,024-entry cache evicts, rebuilding grows memory further). A serving engine sees
    a new row count at almost every step, so without this its RSS grows for thousands of requests.
    Rows are zero-padded up to `row_bucket` and calls beyond ROW_CHUNK rows are split, so one weight
    meets at most 44 shapes; the padding rows are computed and dropped. The chunks of a split call are written
    into one output as they come, so at most one chunk's result is alive beside it (a Gemma 3 window's logits,
    2,048 x 262,144 fp32: 2.5 GiB at the peak instead of 4, and no copy of the whole).
    """
    rows = x.shape[0]
    if rows > ROW_CHUNK:
        first = on_row_buckets(matmul, x[:ROW_CHUNK])
        out = first.new_empty(rows, first.shape[1])
        out[:ROW_CHUNK] = first
        del first
        for i in range(ROW_CHUNK, rows, ROW_CHUNK):
            out[i:i + ROW_CHUNK] = on_row_buckets(matmul, x[i:i + ROW_CHUNK])
        return out
    padded = row_bucket(rows)
    if padded == rows:
        return matmul(x)
    xp = x.new_empty(padded, x.shape[1])  # [bucket, K]
    xp[:rows] = x
    xp[rows:] = 0
    return matmul(xp)[:rows]


def prebuild_row_buckets(model: nn.Module, max_tokens: int, max_logit_rows: int) -> int:
    """Run every oneDNN dense weight shape of `model` once at each row bucket a step can produce, on zeros,
    so that the primitives oneDNN keeps per shape are all built now: memory is then taken once at
    start-up, like the KV cache, instead of creeping up as serving meets new batch sizes.

    Primitives belong to shapes, not weights, so one layer of each distinct shape is run: the decoder
    projections up to `max_tokens` rows (a step's token budget; more is split into ROW_CHUNK calls),
    the module named `lm_head` (or a dense copy inside it) up to `max_logit_rows` (one row per sequence). Returns the number of calls.
    SmolLM2-135M, fp32, budgets 2,048 / 256: 212 calls, about a second here.
    """
    seen, calls = set(), 0
    for name, module in model.named_modules():
        if not isinstance(module, DenseLinear) or module.packed is None:
            continue
        w = module.weight
        key = (tuple(w.shape), w.dtype, module.bias is None)
        if key in seen:
            continue
        seen.add(key)
        # the lm_head, or a quantized lm_head's dense copy ("lm_head.dense"), takes one row per sequence
        limit = min(max_logit_rows if name.split(".")[0] == "lm_head" else max_tokens, ROW_CHUNK)
        first = max(module.fewest_rows, module.small_rows + 1)  # fewer rows take the GEMV or MKL, never oneDNN
        for rows in sorted({row_bucket(m) for m in range(first, limit + 1)}):
            module(torch.zeros(rows, w.shape[1], dtype=w.dtype))
            calls += 1
    return calls


@functools.lru_cache(maxsize=None)
def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of `dtype` on this CPU: bf16 needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
    (elsewhere its reorder raises, and F.linear's own bf16 path serves)."""
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
