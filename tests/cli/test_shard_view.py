"""`llmopt shard`'s table: the set of KV heads per rank, why the shares add up past 100%, the pipeline stages."""
from pathlib import Path

import pytest

from llmopt.cli.main import main
from llmopt.cli.shard_view import kv_heads_cell, render, share_note
from llmopt.stages.artifact import Artifact
from llmopt.stages.shard.pipeline import make_pipeline_plan
from llmopt.stages.shard.plan import make_plan

CONFIG = dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, intermediate_size=1536, vocab_size=49152)


def test_kv_heads_are_shown_as_a_set():
    plan = make_plan(CONFIG, 2)  # rank 0: query heads 0-4 read KV heads 0,0,0,1,1 (uneven: a copy per query head)
    assert plan["ranks"][0]["kv_heads"] == [0, 0, 0, 1, 1]
    assert [kv_heads_cell(r["kv_heads"]) for r in plan["ranks"]] == ["0,1", "1,2"]


def test_share_note_names_what_is_replicated():
    note = share_note(make_plan(CONFIG, 2), 1.044)
    assert note.startswith("shares add up to 104.4%: the norms are replicated on every rank")
    assert "KV head 1 is replicated" in note and "ranks 0,1 hold a copy of a KV head per query head" in note
    mha = make_plan(dict(CONFIG, num_key_value_heads=9), 3)  # no KV head read by two ranks
    assert share_note(mha, 1.01) == "shares add up to 101.0%: the norms are replicated on every rank"


def test_render_prints_the_sets_and_the_note(capsys):
    plan = make_plan(CONFIG, 4)  # KV heads 0 | 1 | 1,2 | 2
    art = Artifact(Path("out/w4-tp4"), {"model": {"tensor_parallel": plan}})
    render(art, {"rank_bytes": [261, 261, 261, 261], "source_bytes": 1000})
    shown = capsys.readouterr().out
    assert "1,2" in shown and "shares add up to 104.4%" in shown and "KV heads 1,2 are replicated" in shown


@pytest.fixture(scope="module")
def seven_layers(tmp_path_factory):
    from tests.helpers import write_hf_dir

    path = tmp_path_factory.mktemp("seven") / "model"
    write_hf_dir(path, layers=7, hidden=64, heads=4, kv_heads=2)
    return path


def test_shard_pp3_prints_stages_and_layers(seven_layers, tmp_path, capsys):
    out = tmp_path / "pp3"
    assert main(["shard", str(seven_layers), "--pp", "3", "-o", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "sharded for --tp 1 --pp 3" in shown and "stage" in shown and "layers" in shown
    for cells in ("embed + 0-1 (2)", "2-4 (3)", "5-6 (2) + head"):
        assert cells in shown
    assert "holds its own copy of the embedding" in shown and "starts 3 rank processes" in shown
    assert "shares add up" not in shown  # no TP: only the tied copy is repeated, and its line says so


def test_render_pp2_tp3_numbers_ranks_globally(capsys):
    config = dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128, intermediate_size=256,
                  vocab_size=300, num_hidden_layers=30)
    plan = make_plan(config, 3)  # query heads 0-2 | 3-5 | 6-7: TP index 1 holds a KV copy per query head
    pipeline = make_pipeline_plan(config, [(0, 15), (15, 30)], 3, [5, 5], "bytes")
    render(Artifact(Path("out/pp2"), {"model": {"tensor_parallel": plan, "pipeline_parallel": pipeline}}),
           {"rank_bytes": [20] * 6, "source_bytes": 100})
    shown = capsys.readouterr().out
    rows = [line.strip("│").split("│") for line in shown.splitlines() if line.startswith("│")]
    rows = [[cell.strip() for cell in row] for row in rows]
    assert [r[:3] for r in rows] == [[str(g), str(g // 3), "embed + 0-14 (15)" if g < 3 else "15-29 (15) + head"]
                                     for g in range(6)]
    assert "starts 6 rank processes" in shown and "every rank of a stage" in shown
    assert "ranks 1,4 hold a copy of a KV head per query head" in shown  # global ranks, not TP indices


def test_bad_pp_layers_is_one_line_and_writes_nothing(seven_layers, tmp_path, capsys):
    out = tmp_path / "bad"
    assert main(["shard", str(seven_layers), "--pp", "2", "--pp-layers", "0-2,4-6", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # after the "reading SRC" status line
    assert [line for line in err if line.startswith("error:")] == err[-1:] and "layer 3 is missing" in err[-1], err
    assert not out.exists() and list(tmp_path.iterdir()) == []
