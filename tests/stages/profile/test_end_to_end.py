"""Part d of scripts/gpu_check.sh on CPU with the tiny shape: a synthetic model written with its chat
tokenizer (`profile --save-model`), `llmopt quantize` RTN W4A16 on it, then `llmopt bench --server`, which
starts `llmopt serve` on the result: every chat request completes."""
import json

from llmopt.cli.main import main


def test_save_quantize_serve_bench(tmp_path, capsys):
    base, quantized, report = tmp_path / "synthetic", tmp_path / "w4a16", tmp_path / "bench.json"
    assert main(["profile", "--synthetic", "tiny", "--layers", "2", "--save-model", str(base)]) == 0
    assert main(["quantize", str(base), "-o", str(quantized), "--method", "rtn", "--scheme", "W4A16",
                 "--eval-windows", "0"]) == 0
    code = main(["bench", "--server", str(quantized), "--endpoint", "chat", "--dataset", "random", "--input-len", "12",
                 "--output-len", "6", "--ignore-eos", "--num-prompts", "6", "--max-concurrency", "3", "--quiet",
                 "--server-timeout", "120", "--json", str(report)])
    assert code == 0, capsys.readouterr().err[-2000:]
    result = json.loads(report.read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (6, 0, 36)
    manifest = json.loads((quantized / "llmopt.json").read_text())
    assert [e["stage"] for e in manifest["lineage"]] == ["synthetic", "quantize"]
