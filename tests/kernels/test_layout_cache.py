"""The layout cache (kernels/layout_cache.py): a miss builds and stores, a hit reads back without building,
a damaged or stale file is rebuilt, concurrent writers leave one whole file, kept tensors stay references."""
import os
import threading

import pytest
import torch

from llmopt.kernels import cpu_native, cpu_quant
from llmopt.kernels.layout_cache import LayoutCache, cached_layout, layout_key


def _int4(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (8, 64), generator=g, dtype=torch.uint8)
    return cpu_native.Int4Weight(q, torch.rand(8, 2, generator=g) + 0.1, None, 32)


class Builds:
    """Counts builds of one layout."""

    def __init__(self, seed: int = 0):
        self.count, self.seed = 0, seed

    def __call__(self):
        self.count += 1
        return _int4(self.seed)


def _same(a, b) -> None:
    assert type(a) is type(b)
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other) and value.dtype == other.dtype, name
        else:
            assert value == other, name


def _round_trip(folder, key="k" * 32, build=None):
    build = build or Builds()
    cache = LayoutCache.open(folder, key)
    with cache.scope("layers.0.qkv"):
        weight = cached_layout("native", build)
    return cache, weight, build


def test_miss_then_hit_reads_the_same_layout_without_building(tmp_path):
    cache, built, build = _round_trip(tmp_path)
    assert build.count == 1 and cache.describe().startswith("miss") and cache.save()
    again, read, build2 = _round_trip(tmp_path)
    assert build2.count == 0 and again.describe() == "hit (1 layouts)" and not again.save()
    _same(built, read)
    assert read.tiles.data_ptr() % 64 == 0  # aligned for the GEMV's vector loads
    x = torch.randn(3, 64)
    assert torch.equal(cpu_native.gemv_w4(x, read), cpu_native.gemv_w4(x, built)) if cpu_native.gemv_available() \
        else True


def test_no_scope_just_builds(tmp_path):
    build = Builds()
    cached_layout("native", build)
    assert build.count == 1 and not list(tmp_path.iterdir())


def test_another_key_is_another_file(tmp_path):
    _round_trip(tmp_path, "a" * 32)[0].save()
    cache, _, build = _round_trip(tmp_path, "b" * 32)
    assert build.count == 1 and cache.status == "miss"
    assert layout_key("x", "cpu-native", torch.float32) != layout_key("y", "cpu-native", torch.float32)
    assert layout_key("x", "cpu-native", torch.float32) != layout_key("x", "cpu-torch", torch.float32)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_file_is_rebuilt_never_used(tmp_path, damage):
    cache, built, _ = _round_trip(tmp_path)
    cache.save()
    data = bytearray(cache.path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF  # inside the last tensor: only the checksum can tell
    elif damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data = bytearray(b"not a layout file at all")
    cache.path.write_bytes(bytes(data))
    again, read, build = _round_trip(tmp_path)
    assert build.count == 1 and again.status.startswith("rebuilt"), again.status
    _same(built, read)
    assert again.save()  # the rebuilt file replaces the damaged one
    third, _, build3 = _round_trip(tmp_path)
    assert build3.count == 0 and third.status == "hit"


def test_a_checked_file_is_trusted_by_its_stamp_until_it_changes(tmp_path, monkeypatch):
    import llmopt.kernels.layout_cache as lc

    _round_trip(tmp_path)[0].save()
    _round_trip(tmp_path)  # first read: hashed, stamped
    hashed = []
    monkeypatch.setattr(lc, "_sha256_from", lambda f, start: hashed.append(1) or "x")
    assert _round_trip(tmp_path)[2].count == 0 and not hashed  # stamp matches: not read again
    path = next(tmp_path.glob("*.bin"))
    os.utime(path, ns=(1, 1))  # touched: hashed again (and the fake hash fails: rebuilt)
    assert _round_trip(tmp_path)[2].count == 1 and hashed


def test_a_class_outside_the_kernels_is_never_restored(tmp_path):
    cache, _, _ = _round_trip(tmp_path)
    cache.save()
    # Same length, so the header still parses; the data's checksum still holds: only the class check refuses.
    cache.path.write_bytes(cache.path.read_bytes().replace(b"llmopt.kernels.cpu_native", b"llmopt.kernelz.cpu_native"))
    again, read, build = _round_trip(tmp_path)
    assert build.count == 1 and again.status.startswith("rebuilt") and isinstance(read, cpu_native.Int4Weight)


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    barrier = threading.Barrier(4)
    errors = []

    def start():
        try:
            cache, _, _ = _round_trip(tmp_path)
            barrier.wait()
            cache.save()
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [p.suffix for p in sorted(tmp_path.iterdir())] in (['.bin'], ['.bin', '.ok'])  # no temporary files left
    cache, read, build = _round_trip(tmp_path)
    assert build.count == 0 and cache.status == "hit"
    _same(_int4(), read)


def test_kept_tensors_are_references_not_copies(tmp_path):
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(-2**31, 2**31 - 1, (16, 8), generator=g, dtype=torch.int32)  # [N, K / 8]
    scale = torch.rand(16, 2, generator=g) + 0.1
    keep = {"weight_packed": packed, "weight_scale": scale}

    def pack():
        return cpu_quant.pack_w4a16_for_cpu(packed, scale, 64, None, 32)

    for expect_builds in (1, 0):
        cache = LayoutCache.open(tmp_path, "c" * 32)
        with cache.scope("layers.0.o_proj"):
            built = Builds()
            weight = cached_layout("torch", lambda: (built(), pack())[1], keep=keep)
        cache.save()
        assert built.count == expect_builds
        if weight is None:  # this torch has no int4 CPU kernel
            return
        assert weight.source[0] is packed and weight.source[1] is scale
    stored = cache.path.stat().st_size
    assert stored < packed.numel() * 4 + weight.packed.numel() * weight.packed.element_size() + 4096


def test_a_layout_that_cannot_be_stored_is_built_each_time_and_the_rest_kept(tmp_path):
    class Opaque:  # not a kernels class: never stored, never restored
        pass

    def start():
        cache = LayoutCache.open(tmp_path, "d" * 32)
        builds = Builds()
        with cache.scope("layers.0.qkv"):
            cached_layout("native", builds)
        with cache.scope("layers.0.o_proj"):
            odd = cached_layout("opaque", lambda: (builds(), Opaque())[1])
        return cache, builds, odd

    first, builds, _ = start()
    assert builds.count == 2 and first.save()
    again, builds, odd = start()
    assert builds.count == 1 and isinstance(odd, Opaque)  # the stored one read, the opaque one built
    assert again.describe() == "hit (1 layouts)" and not again.save()  # nothing new to write
