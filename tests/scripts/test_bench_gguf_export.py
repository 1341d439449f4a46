"""scripts/bench_gguf_export.py: how it reads llama-perplexity and llama-bench, the tensor types of a file, and its
table. The benchmark itself builds llama.cpp and quantizes with GPTQ: `make bench-gguf-export`."""
import importlib.util
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_gguf_export.py"
spec = importlib.util.spec_from_file_location("bench_gguf_export", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_final_estimate_is_read_from_llama_perplexity_output():
    text = ("[1]14.2035,[2]17.0171,[3]16.6447,\nFinal estimate: PPL = 16.6447 +/- 0.51302\n\n"
            "llama_perf_context_print:        load time =      58.17 ms\n")
    assert bench.final_estimate(text) == pytest.approx(16.6447)
    assert bench.final_estimate("[1]14.2035,[2]17.0171,\nllama_perf_context_print: ...") is None


def test_bench_medians_take_each_file_and_test_over_rounds():
    def rec(name, prompt, gen, ts):
        return {"model_filename": name, "n_prompt": prompt, "n_gen": gen, "avg_ts": ts}

    rounds = [[rec("/a.gguf", 512, 0, 300.0), rec("/a.gguf", 0, 128, 90.0), rec("/b.gguf", 512, 0, 280.0),
               rec("/b.gguf", 0, 128, 88.0)],
              [rec("/b.gguf", 512, 0, 290.0), rec("/b.gguf", 0, 128, 86.0), rec("/a.gguf", 512, 0, 320.0),
               rec("/a.gguf", 0, 128, 70.0)],
              [rec("/a.gguf", 512, 0, 310.0), rec("/a.gguf", 0, 128, 95.0), rec("/b.gguf", 512, 0, 270.0),
               rec("/b.gguf", 0, 128, 87.0)]]
    medians = bench.bench_medians(rounds, {"/a.gguf": "a", "/b.gguf": "b"})
    assert medians == {"a": {"pp512": 310.0, "tg128": 90.0}, "b": {"pp512": 280.0, "tg128": 87.0}}


def test_tensor_types_count_what_the_file_holds(tmp_path):
    import gguf

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for i in range(3):
        weights = rng.standard_normal((4, 64), dtype=np.float32)
        writer.add_tensor(f"blk.{i}.w", gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0),
                          raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("norm", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert bench.tensor_types(path) == "Q8_0 x3, F32 x1"


def test_table_compares_every_file_with_llama_cpp_q4_0():
    args = Namespace(source="smollm2-135m", chunks=32, ctx=2048, threads=2, rounds=3, nsamples=128, seqlen=2048)
    row = {"types": "Q4_0 x210, Q8_0 x1, F32 x61", "mib": 81.2}
    results = {"llama-q4_0": {**row, "ppl": 20.0, "pp512": 300.0, "tg128": 100.0},
               "llmopt-gptq-q4_0": {**row, "ppl": 18.0, "pp512": 297.0, "tg128": 101.0, "seconds": 361.4}}
    lines = bench.table(results, args, 16.5).splitlines()
    assert "32 windows of 2048 tokens" in lines[0] and "F32 base 16.5000" in lines[0]
    assert lines[4].startswith("| llama-q4_0 | llama-quantize Q4_0") and lines[4].endswith(
        "| 81.2 |  | 20.0000 | 1.000x | 300 | 100.0 | 1.000x |")
    assert lines[5].endswith("| 81.2 | 361 | 18.0000 | 0.900x | 297 | 101.0 | 1.010x |")
