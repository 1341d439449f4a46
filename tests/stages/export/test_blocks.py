"""GGUF blocks from codes and scales: gguf's own dequantizer reads back q * d exactly, the bytes are the ones
gguf's own quantizer writes for the same grid, and llama.cpp's row order is the one transformers undoes."""
import gguf
import numpy as np
import pytest
import torch

from llmopt.stages.export.blocks import fp16_exact, llama_rows, pack_blocks

QTYPE = {4: gguf.GGMLQuantizationType.Q4_0, 8: gguf.GGMLQuantizationType.Q8_0}
RANGE = {4: (-8, 7), 8: (-128, 127)}


def _codes(bits: int, rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lo, hi = RANGE[bits]
    q = torch.randint(lo, hi + 1, (rows, cols), generator=g, dtype=torch.int8)
    d = (torch.rand(rows, cols // 32, generator=g) * 0.05 + 1e-3).half()
    return q, d


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows, cols", [(1, 32), (3, 64), (17, 96)])
def test_gguf_dequantizes_the_blocks_to_exactly_q_times_d(bits, rows, cols):
    q, d = _codes(bits, rows, cols)
    blocks = pack_blocks(q, d, bits)
    assert blocks.dtype == np.uint8 and blocks.shape == (rows, cols // 32 * (18 if bits == 4 else 34))
    expect = (q.float().view(rows, -1, 32) * d.float()[..., None]).view(rows, cols)  # [R, B, 32] -> [R, cols]
    assert np.array_equal(gguf.quants.dequantize(blocks, QTYPE[bits]), expect.numpy())


@pytest.mark.parametrize("bits", [4, 8])
def test_the_bytes_are_those_gguf_s_quantizer_writes_on_the_same_grid(bits):
    # Pin each block's largest magnitude to the end of the grid gguf's quantizer picks (-8 d for Q4_0, +-127 d for
    # Q8_0): it then finds the same d and codes, and must write the very same bytes.
    q, d = _codes(bits, 5, 64, seed=1)
    q = q.clamp(-7 if bits == 4 else -126, 7 if bits == 4 else 126)
    q.view(5, 2, 32)[:, :, 3] = -8 if bits == 4 else 127
    w = (q.float().view(5, 2, 32) * d.float()[..., None]).view(5, 64).numpy()
    assert np.array_equal(pack_blocks(q, d, bits), gguf.quants.quantize(w, QTYPE[bits]))


def test_q4_0_nibbles_hold_weight_j_low_and_j_plus_16_high():
    q = torch.arange(32, dtype=torch.int8).remainder(16).sub(8).view(1, 32)  # -8..7, -8..7
    block = pack_blocks(q, torch.ones(1, 1).half(), 4)[0]
    assert block[:2].tobytes() == np.float16(1).tobytes()
    assert [b & 0xF for b in block[2:]] == [int(v) + 8 for v in q[0, :16]]
    assert [b >> 4 for b in block[2:]] == [int(v) + 8 for v in q[0, 16:]]


def test_codes_outside_the_block_range_are_refused():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_blocks(torch.full((1, 32), 9, dtype=torch.int8), torch.ones(1, 1).half(), 4)
    with pytest.raises(ValueError, match="groups of 32"):
        pack_blocks(torch.zeros(1, 32, dtype=torch.int8), torch.ones(1, 2).half(), 8)


@pytest.mark.parametrize("heads, rows", [(4, 32), (2, 16), (9, 9 * 64)])
def test_llama_rows_is_what_transformers_gguf_loader_undoes(heads, rows):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.randn(rows, 3)
    back = LlamaTensorProcessor()._reverse_permute_weights(llama_rows(w, heads).numpy(), heads, heads)
    assert np.array_equal(back, w.numpy())
    assert not torch.equal(llama_rows(w, heads), w)


def test_fp16_exact():
    assert fp16_exact(torch.tensor([0.1, 3e-3, 2.0 ** -24]).half().bfloat16())  # bf16 values that fp16 holds
    assert fp16_exact(torch.tensor([0.125, 1.5], dtype=torch.bfloat16))
    assert not fp16_exact(torch.tensor([0.1]))  # fp32 0.1 is not an fp16 number
    assert not fp16_exact(torch.tensor([1e5], dtype=torch.bfloat16))  # beyond fp16's range
    assert not fp16_exact(torch.tensor([2.0 ** -30], dtype=torch.bfloat16))  # below its subnormals
