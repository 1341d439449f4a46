import json

import pytest
import torch

from llmopt.stages.artifact import MANIFEST, TMP_PREFIX, Artifact, ArtifactWriter
from llmopt.stages.errors import ArtifactError
from llmopt.stages.importer import import_source
from llmopt.stages.model_io import load_model_dir
from llmopt.stages.source import resolve


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture
def base(tiny_hf, tmp_path):
    path, _, _ = tiny_hf
    return import_source(resolve(str(path)), tmp_path / "base")


def test_round_trip_keeps_logits_and_writes_manifest(tiny_hf, base):
    _, model, _ = tiny_hf
    ids = torch.tensor([[1, 5, 9, 33, 2, 7]])
    loaded = load_model_dir(base.path, files=base.weight_files)
    assert torch.equal(_logits(model, ids), _logits(loaded, ids))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # still tied
    m = json.loads((base.path / MANIFEST).read_text())
    assert m["stage"] == "import" and m["parent"] is None and len(m["lineage"]) == 1
    assert m["source"]["kind"] == "hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(m["files"])
    assert m["metrics"]["num_parameters"] == sum(p.numel() for p in model.parameters())
    Artifact.open(base.path)  # verifies every hash


def test_lineage_and_parent_across_generations(base, tmp_path):
    child = import_source(resolve(str(base.path)), tmp_path / "child", dtype=torch.bfloat16)
    m = child.manifest
    assert m["parent"]["content_hash"] == base.content_hash
    assert [e["stage"] for e in m["lineage"]] == ["import", "import"]
    assert m["lineage"][0]["content_hash"] == base.content_hash
    assert m["source"]["kind"] == "hf"  # the root source is carried down
    assert m["model"]["dtype"] == "bf16"
    assert load_model_dir(child.path).lm_head.weight.dtype == torch.bfloat16


def test_tampered_weight_file_is_named(base):
    f = base.path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"model\.safetensors: sha256 does not match"):
        Artifact.open(base.path)


def test_truncated_weight_file_is_named(base):
    f = base.path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match=r"model\.safetensors: size .*truncated"):
        Artifact.open(base.path)


def test_corrupted_manifest_is_reported(base):
    (base.path / MANIFEST).write_text("{not json")
    with pytest.raises(ArtifactError, match="corrupted manifest"):
        Artifact.open(base.path)


def test_failed_write_leaves_nothing(tmp_path):
    dest = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with ArtifactWriter(dest) as w:
            (w.tmp / "model.safetensors").write_bytes(b"partial")
            raise RuntimeError("stage failed half way")
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []


def test_failing_stage_leaves_no_artifact(tiny_hf, tmp_path, monkeypatch):
    import llmopt.stages.model_io as model_io

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(model_io, "save_model", boom)
    with pytest.raises(OSError):
        import_source(resolve(str(tiny_hf[0])), tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_existing_destination_needs_force(base, tiny_hf, tmp_path):
    src = resolve(str(tiny_hf[0]))
    with pytest.raises(ArtifactError, match="already exists"):
        import_source(src, base.path)
    old_hash = base.content_hash
    again = import_source(src, base.path, force=True, dtype=torch.float16)
    assert again.content_hash != old_hash and Artifact.open(base.path).manifest["model"]["dtype"] == "fp16"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TMP_PREFIX)]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("precious")
    with pytest.raises(ArtifactError, match="not an llmopt artifact"):
        import_source(src, other, force=True)
    assert (other / "mine.txt").read_text() == "precious"


def test_sharded_weights_with_index(tiny_hf, tmp_path):
    _, model, _ = tiny_hf
    art = import_source(resolve(str(tiny_hf[0])), tmp_path / "sharded", max_shard_bytes=20_000)
    assert len(art.weight_files) > 2
    index = json.loads((art.path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(art.weight_files)
    ids = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(_logits(model, ids), _logits(load_model_dir(art.path), ids))


def test_metrics_update_keeps_identity(base):
    base.update_metrics("eval/x", {"perplexity": 3.0})
    again = Artifact.open(base.path)
    assert again.manifest["metrics"]["eval/x"]["perplexity"] == 3.0
    assert again.content_hash == base.content_hash
