"""`llmopt profile --memory`: the ledger counts every byte once, and the categories sum to the RSS."""
import json

import pytest
import torch

from llmopt.kernels import cpu_native, cpu_prefill, select_backend
from llmopt.stages.errors import ConfigError
from llmopt.stages.profile.config import ProfileConfig
from llmopt.stages.profile.memory import COPIES, LOADED, Ledger, account_linear, memory_tables, run_memory
from llmopt.stages.profile.modes import check_sources
from tests.kernels.helpers import quantize_int4


def test_ledger_counts_each_byte_once():
    ledger, big = Ledger(), torch.zeros(100)  # 400 bytes, one storage
    ledger.add("a", "first half", big[:50])
    ledger.add("b", "overlapping view", big[25:75], big[:50].view(5, 10))
    ledger.add("c", "the rest, twice", big[50:], big)
    assert ledger.bytes == {("a", "first half"): 200, ("b", "overlapping view"): 100, ("c", "the rest, twice"): 100}
    ledger.add("d", "strided", torch.zeros(4, 8)[:, :2])  # spans rows 0..3: 3 * 8 + 2 elements
    ledger.add("e", "meta and None", torch.zeros(8, device="meta"), None)
    assert ledger.bytes[("d", "strided")] == 26 * 4 and ledger.total() == 400 + 104


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN missing from this torch build")
def test_onednn_opaque_tensors_count_by_size():
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(32, 16), 8)
    ledger = Ledger()
    ledger.add(COPIES, "oneDNN", packed, packed)
    assert ledger.total() == 32 * 16 * 4


@pytest.mark.parametrize("backend", [pytest.param("cpu-native", marks=pytest.mark.skipif(
    not cpu_native.gemv_available(), reason="native GEMV needs AVX-512")), "cpu-torch"])
def test_a_w4a16_layer_is_its_compressed_tensors_plus_its_kernel_layouts(backend):
    t = quantize_int4(torch.randn(64, 128, generator=torch.Generator().manual_seed(0)), 32, True)
    layer = select_backend(backend).quantized_linear("w4a16", t, 32)
    ledger = Ledger()
    account_linear(ledger, layer)
    loaded = t["weight_packed"].nbytes + t["weight_scale"].nbytes
    cpu = layer.cpu_weight  # None on cpu-native with AMX: its prefill kernel reads the compressed tensors
    pack = 0 if cpu is None else cpu.packed.nbytes + cpu.scales_and_zeros.nbytes
    tiles = 0 if layer.native is None else layer.native.weight.tiles.nbytes + layer.native.weight.scales.nbytes
    assert ledger.total(LOADED) == loaded and ledger.total(COPIES) == pack + tiles
    if cpu is not None:
        assert ledger.bytes[(COPIES, "torch Int4CpuWeight (w4a16)")] == pack  # `source` is the loaded tensors
    assert (cpu is None) == (backend == "cpu-native" and cpu_prefill.amx_available())


def test_memory_takes_one_source():
    with pytest.raises(ConfigError, match="one SOURCE"):
        check_sources([], ProfileConfig(memory=True))
    with pytest.raises(ConfigError, match="--max-num-seqs must be at least 1"):
        ProfileConfig(memory=True, max_num_seqs=0).validate()


def test_the_categories_sum_to_the_rss(tiny_sources):
    config = ProfileConfig(memory=True, max_model_len=64, max_num_seqs=2, block_size=8, threads=1)
    report = run_memory(tiny_sources[1], config)
    assert sum(b for _, _, b in report["categories"]) == report["rss"] > 0
    kv = [b for c, _, b in report["categories"] if c == "KV cache"]
    token_bytes = 2 * 2 * 16 * 2 * 4  # layers x KV heads x head dim x (K, V) x fp32 (hidden 64, 4 heads)
    assert report["kv_cache"].startswith("KV cache: 128 tokens (64 x 2 seqs") and kv == [128 * token_bytes]
    assert report["weights_bytes"] > 0 and report["kernel_copy_bytes"] > 0
    assert list(report["phases"]) == ["libraries", "tokenizer", "loaded", "kv_cache", "prebuilt", "served"]
    table = memory_tables(json.loads(json.dumps(report)))[0]
    assert table.rows[-1][:2] == ["RSS", "after one request"] and any(r[0] == "unaccounted" for r in table.rows)
