import pytest
import torch
from compressed_tensors.compressors.pack_quantized import helpers as ct_pack

from llmopt.stages.ctpack import (pack_int4, pack_to_int32, pack_zero_point, unpack_from_int32,
                                         unpack_int4_signed, unpack_zero_point)

SHAPES = [(7, 576), (33, 64), (5, 40), (3, 13), (1, 8)]


def codes(shape, bits, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lo = -(1 << (bits - 1))
    return torch.randint(lo, -lo, shape, generator=gen, dtype=torch.int64).to(torch.int8)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_matches_compressed_tensors_bit_exact(bits, shape, dim):
    q = codes(shape, bits, seed=bits)
    ours = pack_to_int32(q, bits, packed_dim=dim)
    theirs = ct_pack.pack_to_int32(q, bits, packed_dim=dim)
    assert ours.dtype == torch.int32 and torch.equal(ours, theirs)
    assert torch.equal(unpack_from_int32(ours, bits, q.shape, packed_dim=dim), q)
    if not (bits == 4 and dim == 0 and ours.shape[0] == 1):  # the library fails there: see the test below
        assert torch.equal(ct_pack.unpack_from_int32(ours, bits, torch.Size(q.shape), packed_dim=dim), q)


def test_one_word_over_the_output_dim_unpacks_where_the_library_alone_fails():
    # compressed-tensors 0.20.1 views a [1, n] int32 transposed to [n, 1] as bytes and raises
    q = codes((7, 576), 4)
    packed = ct_pack.pack_to_int32(q, 4, packed_dim=0)  # [1, 576]
    with pytest.raises(RuntimeError, match="stride"):
        ct_pack.unpack_from_int32(packed, 4, torch.Size(q.shape), packed_dim=0)
    assert torch.equal(unpack_zero_point(packed, 4, 7), q)


@pytest.mark.parametrize("bits", [4, 8])
def test_unpacked_codes_are_contiguous(bits):
    q = codes((11, 9), bits, seed=1)
    for dim in (0, 1):
        out = unpack_from_int32(pack_to_int32(q, bits, dim), bits, q.shape, dim)
        assert out.is_contiguous() and out.dtype == torch.int8


def test_packing_calls_compressed_tensors(monkeypatch):
    # our module adds checks around the library's packing; it carries no second copy of it
    calls, pack, unpack = [], ct_pack.pack_to_int32, ct_pack.unpack_from_int32
    monkeypatch.setattr(ct_pack, "pack_to_int32", lambda *a: calls.append("pack") or pack(*a))
    monkeypatch.setattr(ct_pack, "unpack_from_int32", lambda *a: calls.append("unpack") or unpack(*a))
    q = codes((5, 40), 4)
    assert torch.equal(unpack_int4_signed(pack_int4(q), 40), q)
    assert calls == ["pack", "unpack"]


def test_int4_layout_column_8c_plus_j_in_bits_4j():
    q = torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7, 5, -1]], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.shape == (1, 2)
    word = packed[0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * j)) & 0xF for j in range(8)] == [v + 8 for v in q[0, :8].tolist()]
    assert packed[0, 1].item() == (5 + 8) | ((-1 + 8) << 4)
    assert torch.equal(unpack_int4_signed(packed, 10), q)


def test_int4_extremes_roundtrip():
    q = torch.full((3, 16), 7, dtype=torch.int8)
    q[1] = -8
    assert torch.equal(unpack_int4_signed(pack_int4(q), 16), q)
    assert pack_int4(q)[0, 0].item() == -1  # 0xFFFFFFFF: fifteen in every nibble, as int32


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_point_packs_along_the_output_dim(bits):
    zp = codes((11, 9), bits, seed=3)  # [out, in/g], odd out
    packed = pack_zero_point(zp, bits)
    assert packed.shape == (-(-11 * bits // 32), 9)
    assert torch.equal(packed, ct_pack.pack_to_int32(zp, bits, packed_dim=0))
    assert torch.equal(unpack_zero_point(packed, bits, 11), zp)


def test_out_of_range_codes_are_refused():
    with pytest.raises(ValueError, match="range"):
        pack_int4(torch.tensor([[8]], dtype=torch.int8))
    with pytest.raises(ValueError):
        pack_to_int32(torch.zeros(2, 2, dtype=torch.int32), 4)


@pytest.mark.parametrize("bits,packed_dim", [(8, 1), (4, 1), (4, 0), (3, 1)])
def test_unpack_in_row_chunks_equals_one_pass(monkeypatch, bits, packed_dim):
    # rows unpacked a few at a time (a ragged last chunk) give the codes that were packed
    from llmopt.stages import ctpack

    lo = -(1 << (bits - 1))
    q = torch.randint(lo, -lo, (37, 29), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    packed = ctpack.pack_to_int32(q, bits, packed_dim)
    monkeypatch.setattr(ctpack, "UNPACK_ROWS", 8)
    assert torch.equal(ctpack.unpack_from_int32(packed, bits, q.shape, packed_dim), q)
