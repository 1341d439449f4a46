"""`llmopt profile`: options to config, files written, and user errors as one line with exit 2."""
import json

import pytest
import torch

from llmopt.cli.main import main

SMALL = ["--prompt-lens", "8,16", "--batch-sizes", "1,4", "--context-lens", "8,32", "--decode-context", "16",
         "--decode-steps", "2", "--repeats", "1", "--memory-budget", "64MiB", "--plan-context", "64",
         "--target-tpot-ms", "500"]


def test_profile_writes_json_and_html_and_prints_tables(tiny_sources, tmp_path, capsys):
    argv = ["profile", tiny_sources[1], "--quick", *SMALL, "--json", str(tmp_path / "p.json"),
            "--html", str(tmp_path / "p.html")]
    assert main(argv) == 0
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["config"]["batch_sizes"] == [1, 4] and report["config"]["target_tpot_ms"] == 500
    assert report["sources"][0]["capacity"]["context"] == 64
    assert (tmp_path / "p.html").read_text().startswith("<!DOCTYPE html>")
    printed = " ".join(capsys.readouterr().out.split())  # titles with long paths wrap on a narrow console
    for title in ("decode roofline", "per-layer time", "capacity at context 64", "sources side by side"):
        assert title in printed


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    return err[0]


@pytest.mark.parametrize("argv, expect", [
    (["profile", "/no/such/model"], "no such file or directory"),
    (["profile", "TINY", "--batch-sizes", "4,8"], "must include 1"),
    (["profile", "TINY", "--prompt-lens", "lots"], "--prompt-lens"),
    (["profile", "TINY", "--target-tpot-ms", "-3"], "--target-tpot-ms"),
    (["profile", "TINY", "--memory-budget", "plenty"], "--memory-budget"),
    (["profile", "TINY", "--decode-steps", "0"], "--decode-steps"),
    (["profile", "TINY", "--prompt-lens", "4096"], "no --prompt-lens value fits the model's 256 positions"),
    (["profile"], "Missing argument"),
    (["profile", "TINY", "--device", "npu"], "--device must be cpu or cuda"),
    (["profile", "TINY", "--html", "FILE/r.html"], "--html FILE/r.html: cannot create"),
    (["profile", "TINY", "--json", "."], "is a directory"),
])
def test_user_errors_give_one_line_and_exit_2(argv, expect, tiny_sources, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("a file, not a folder")
    argv = [tiny_sources[0] if a == "TINY" else a for a in argv]
    assert main(argv) == 2
    assert expect in _err_line(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_fails_before_measuring(tiny_sources, capsys):
    assert main(["profile", tiny_sources[0], "--device", "cuda"]) == 2
    assert "no CUDA device is visible" in _err_line(capsys)
