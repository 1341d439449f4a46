"""ModelRunner: KV cache sizing and allocation."""
import pytest
import torch

from llmopt.stages.errors import ConfigError
from llmopt.stages.serve import runner as runner_mod
from llmopt.stages.serve.loader import load_runtime
from llmopt.stages.serve.model import spec_from_config
from llmopt.stages.serve.runner import (ModelRunner, kv_bytes_per_block, num_kv_blocks, parse_kv_cache_memory,
                                        make_resident, resident_zeros)
from tests.stages.serve.runner_steps import Sequences, hf_last_logits

CONFIG = dict(model_type="llama", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("text, expected", [("0.5", 0.5), (0.9, 0.9), ("1", 1.0), ("4GiB", 4 << 30),
                                            ("512MB", 512 * 10**6), ("1e9", 10**9), (2048, 2048), ("3 G", 3 << 30),
                                            ("1.5kib", 1536)])
def test_parse_kv_cache_memory(text, expected):
    value = parse_kv_cache_memory(text)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("text", ["lots", "-1", "0", "4XB", ""])
def test_parse_kv_cache_memory_rejects_garbage(text):
    with pytest.raises(ConfigError, match="kv-cache-memory"):
        parse_kv_cache_memory(text)


def test_blocks_from_bytes_and_from_a_fraction_of_free_memory(monkeypatch):
    spec = spec_from_config(CONFIG)
    per_block = kv_bytes_per_block(spec, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 8 * 4  # k and v, layers, tokens, kv heads, head_dim, fp32
    assert num_kv_blocks(spec, per_block * 10 + 5, 16, torch.float32, "cpu") == 10
    monkeypatch.setattr(runner_mod, "free_memory_bytes", lambda device: per_block * 100)
    assert num_kv_blocks(spec, "0.25", 16, torch.float32, "cpu") == 25
    with pytest.raises(ConfigError, match="no cache block"):
        num_kv_blocks(spec, per_block - 1, 16, torch.float32, "cpu")


def test_free_memory_on_cpu_is_plausible():
    assert 1 << 20 < runner_mod.free_memory_bytes(torch.device("cpu")) < 1 << 50


def test_cache_is_allocated_once_with_the_kernel_layout(tiny_hf):
    runtime, _, _ = load_runtime(str(tiny_hf[0]))
    runner = ModelRunner.with_memory(runtime, 40 * kv_bytes_per_block(runtime.spec, 8, torch.float32), block_size=8)
    assert runner.num_blocks == 40 and len(runner.k_caches) == runtime.spec.num_layers
    assert runner.k_caches[0].shape == runner.v_caches[0].shape == (40, 8, 2, 8)  # [num_blocks, block_size, Hk, D]
    assert runner.k_caches[0].stride() == runner.v_caches[0].stride()
    assert all(k.untyped_storage().data_ptr() == runner.kv_cache.untyped_storage().data_ptr()
               for k in runner.k_caches + runner.v_caches)
    seqs = Sequences(40, 8)
    a = seqs.add(list(range(1, 20)))
    ptr = runner.kv_cache.data_ptr()
    for n in (19, 1, 1):
        seqs.tokens[a].append(7)
        out = runner.execute(seqs.step([(a, n)]))
        torch.testing.assert_close(out[0], hf_last_logits(tiny_hf[1], seqs.tokens[a][:seqs.cached[a]]),
                                   atol=1e-4, rtol=1e-4)
    assert runner.kv_cache.data_ptr() == ptr


def _resident_kib(address: int) -> int:
    """Rss of the mapping holding `address`, from /proc/self/smaps (VmRSS is a per-CPU estimate here)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= address < hi
            elif inside and head[0] == "Rss:":
                return int(head[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_resident_zeros_is_zeroed_writable_and_resident():
    cache = resident_zeros((4, 64, 16, 2, 8, 64), torch.bfloat16, "cpu")  # 8 MiB
    resident = _resident_kib(cache.data_ptr())
    assert cache.shape == (4, 64, 16, 2, 8, 64) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert resident >= 8 * 1024, f"only {resident} KiB of 8 MiB resident after the allocation"
    assert not cache.any()
    layer = cache[3]
    del cache  # a view keeps the mapping alive
    layer.fill_(2.0)
    assert layer.sum().item() == 2.0 * layer.numel()
    assert resident_zeros((0, 4), torch.float32, "cpu").shape == (0, 4)


def test_lazy_resident_zeros_are_usable_at_once_and_made_resident_later_keeping_what_was_written():
    cache = resident_zeros((8, 64, 16, 2, 8, 64), torch.bfloat16, "cpu", lazy=True)  # 16 MiB
    assert _resident_kib(cache.data_ptr()) < 8 * 1024  # mapped, not yet faulted in
    cache[0, 0].fill_(3.0)  # written before the pages are made resident: populating must not undo it
    assert make_resident(cache[2:], chunk=1 << 20)  # a view that starts mid-page, in 1 MiB calls
    assert make_resident(cache)
    assert _resident_kib(cache.data_ptr()) >= 16 * 1024
    assert cache[0, 0].eq(3.0).all() and not cache[1:].any() and not cache[0, 1:].any()


def test_bad_cache_geometry_is_a_config_error(tiny_hf):
    runtime, _, _ = load_runtime(str(tiny_hf[0]))
    with pytest.raises(ConfigError):
        ModelRunner(runtime, 0, 16)


def test_logits_only_for_the_rows_asked(tiny_hf):
    runtime, _, _ = load_runtime(str(tiny_hf[0]))
    runner, seqs = ModelRunner(runtime, 16, 4), Sequences(16, 4)
    a, b = seqs.add(list(range(1, 12))), seqs.add(list(range(3, 9)))
    step = seqs.step([(a, 5), (b, 6)])
    step.logits_indices = step.logits_indices[1:]  # a's chunk is not its last: no logits needed
    out = runner.execute(step)
    assert out.shape == (1, runtime.spec.vocab_size)
    torch.testing.assert_close(out[0], hf_last_logits(tiny_hf[1], seqs.tokens[b]), atol=1e-4, rtol=1e-4)
    step = seqs.step([(a, 6)])
    step.logits_indices = step.logits_indices[:0]
    assert runner.execute(step).shape == (0, runtime.spec.vocab_size)
