"""`llmopt shard`'s table: the set of KV heads per rank, and why the shares add up past 100%."""
from pathlib import Path
from types import SimpleNamespace

from llmopt.cli.shard_view import kv_heads_cell, render, share_note
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
    art = SimpleNamespace(tensor_parallel=plan, path=Path("out/w4-tp4"))
    render(art, {"rank_bytes": [261, 261, 261, 261], "source_bytes": 1000})
    shown = capsys.readouterr().out
    assert "1,2" in shown and "shares add up to 104.4%" in shown and "KV heads 1,2 are replicated" in shown
