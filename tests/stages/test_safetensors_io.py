import pytest
import torch
from safetensors.torch import save_file

from llmopt.stages.errors import ArtifactError
from llmopt.stages.safetensors_io import load_mmap, read_header, save_state_dict, tensor_infos


def test_mmap_load_matches_and_is_copy_on_write(tmp_path):
    f = tmp_path / "w.safetensors"
    tensors = {"a": torch.randn(7, 3), "b": torch.arange(10, dtype=torch.int32),
               "c": torch.randn(5).to(torch.bfloat16)}
    save_file(tensors, str(f))
    before = f.read_bytes()
    loaded = load_mmap(f)
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype
    loaded["a"].zero_()  # writes go to private pages, never to the file
    assert f.read_bytes() == before


def test_tied_tensors_are_saved_once(tmp_path):
    w = torch.randn(4, 4)
    names = save_state_dict({"embed.weight": w, "lm_head.weight": w, "other": torch.ones(2)}, tmp_path)
    assert names == ["model.safetensors"]
    assert set(tensor_infos(tmp_path / "model.safetensors")) == {"embed.weight", "other"}


@pytest.mark.parametrize("payload, message", [(b"\x01", "truncated"), (b"\xff" * 8 + b"{}", "corrupted"),
                                              (b"\x05\x00\x00\x00\x00\x00\x00\x00{oops", "corrupted")])
def test_bad_headers_name_the_file(tmp_path, payload, message):
    f = tmp_path / "bad.safetensors"
    f.write_bytes(payload)
    with pytest.raises(ArtifactError, match=f"bad.safetensors: {message}"):
        read_header(f)
