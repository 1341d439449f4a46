"""`llmopt generate`: resumable JSONL batches, one prompt, chat records, and bad input."""
import json

import pytest
import torch

from llmopt.cli.main import main
from tests.helpers import write_chat_model_dir

PROMPTS = ["the quick brown fox", "a language model", "pack the weights", "twelve small layers", "the lazy dog"]
ENGINE = ["--kv-cache-memory", "4MiB", "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--max-tokens", "8"]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_chat_model_dir(tmp_path_factory.mktemp("tiny-chat"), TEMPLATE)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    return err


def test_batch_is_resumable_and_skips_done_ids(model_dir, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    out = tmp_path / "out.jsonl"
    full = tmp_path / "full.jsonl"
    assert main(["generate", str(model_dir), "-i", prompts, "-o", str(full), *ENGINE]) == 0
    reference = {r["id"]: r for r in read_jsonl(full)}
    assert "5 written" in capsys.readouterr().out
    assert sorted(reference) == list(range(5)) and all(r["completion_tokens"] <= 8 for r in reference.values())

    done = [dict(reference[1], text="kept as it was"), reference[3]]
    out.write_text("".join(json.dumps(r) + "\n" for r in done) + '{"id": 4, "te')  # killed mid-write
    assert main(["generate", str(model_dir), "-i", prompts, "-o", str(out), *ENGINE, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["skipped"] == 2 and report["written"] == 3
    results = read_jsonl(out)
    assert results[:2] == done and len(results) == 5
    assert {r["id"]: r for r in results[2:]} == {i: reference[i] for i in (0, 2, 4)}  # same greedy text

    assert main(["generate", "/no/model/needed", "-i", prompts, "-o", str(out)]) == 0  # nothing left to do
    assert "nothing to do" in capsys.readouterr().err


def test_chat_messages_use_the_template(model_dir, tmp_path):
    chat = [{"role": "user", "content": "the quick brown fox"}]
    rendered = "user: the quick brown fox\nassistant:"
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "chat", "messages": chat}, {"id": "plain", "prompt": rendered}])
    out = tmp_path / "out.jsonl"
    assert main(["generate", str(model_dir), "-i", prompts, "-o", str(out), *ENGINE]) == 0
    by_id = {r["id"]: r for r in read_jsonl(out)}
    assert by_id["chat"]["text"] == by_id["plain"]["text"]  # the tiny tokenizer adds no BOS


def test_single_prompt_streams_to_stdout(model_dir, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": 0, "prompt": PROMPTS[0]}])
    assert main(["generate", str(model_dir), "-i", prompts, "-o", str(tmp_path / "o.jsonl"), *ENGINE]) == 0
    expected = read_jsonl(tmp_path / "o.jsonl")[0]["text"]
    capsys.readouterr()
    assert main(["generate", str(model_dir), "--prompt", PROMPTS[0], *ENGINE]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n" and "prompt tokens" in captured.err


def test_a_single_prompt_sizes_the_engine_for_one_sequence(model_dir, monkeypatch):
    """--prompt runs one sequence: the engine (and its KV cache, capped at what its sequences can use) is built
    for one, not for --max-num-seqs (test_serve_config: --input keeps the default engine)."""
    from llmopt.stages.serve import build

    seen, real = [], build.build_engine
    monkeypatch.setattr(build, "build_engine", lambda source, config, *a, **k: seen.append(config) or
                        real(source, config, *a, **k))
    assert main(["generate", str(model_dir), "--prompt", PROMPTS[0], "--max-num-seqs", "8", "--max-tokens", "2"]) == 0
    assert seen[-1].max_num_seqs == 1


@pytest.mark.parametrize("lines, expect", [
    (["not json"], "p.jsonl line 1: not a JSON object"),
    (['{"prompt": "x"}'], 'line 1: needs an "id"'),
    (['{"id": 1}'], 'exactly one of "prompt"'),
    (['{"id": 1, "prompt": "a", "messages": []}'], 'exactly one of "prompt"'),
    (['{"id": 1, "messages": [{"role": "user"}]}'], '"messages" must be'),
    (['{"id": 1, "prompt": "a"}', "", '{"id": 1, "prompt": "b"}'], "line 3: id 1 appears twice"),
    ([], "no prompts"),
])
def test_bad_input_gives_one_line_and_exit_2(lines, expect, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["generate", "/no/model", "-i", str(tmp_path / "p.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert expect in err_line(capsys)


@pytest.mark.parametrize("argv, expect", [
    (["--prompt", "x", "-i", "p.jsonl", "-o", "o.jsonl"], "either --prompt"),
    (["-i", "p.jsonl"], "either --prompt"),
    ([], "either --prompt"),
    (["-i", "/no/such.jsonl", "-o", "o.jsonl"], "no such prompts file"),
    (["--prompt", "x", "--temperature", "-1"], "temperature must be"),
    (["--prompt", "x", "--max-num-seqs", "64", "--max-num-batched-tokens", "8"], "--max-num-batched-tokens (8)"),
    (["--prompt", "x", "--kv-cache-memory", "lots"], "--kv-cache-memory 'lots'"),
])
def test_bad_options_give_one_line_and_exit_2(argv, expect, capsys):
    assert main(["generate", "/no/model", *argv]) == 2
    assert expect in err_line(capsys)


def test_a_corrupt_output_line_is_reported_not_overwritten(tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": 0, "prompt": "x"}])
    (tmp_path / "o.jsonl").write_text('{"id": 5}\ngarbage\n{"id": 6}\n')
    assert main(["generate", "/no/model", "-i", prompts, "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "o.jsonl line 2: not a generate result" in err_line(capsys)


def test_a_prompt_that_can_never_fit_is_rejected_before_generating(model_dir, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "ok", "prompt": "fox"}, {"id": "long", "prompt": "fox " * 300}])
    out = tmp_path / "o.jsonl"
    assert main(["generate", str(model_dir), "-i", prompts, "-o", str(out), *ENGINE]) == 2
    assert "p.jsonl line 2 (id 'long')" in err_line(capsys) and not out.exists()
