"""The root conftest skips tests that interpret Triton on CPU tensors where CUDA is present (and only there)."""
import pytest
import torch

from tests.conftest import pytest_collection_modifyitems


class _Item:
    def __init__(self, marked: bool):
        self.marks = [pytest.mark.interpreted_triton.mark] if marked else []

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, marker):
        self.marks.append(marker.mark)


@pytest.mark.parametrize("cuda", [True, False])
def test_interpreted_triton_tests_are_skipped_only_beside_cuda(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    interpreted, plain = _Item(True), _Item(False)
    pytest_collection_modifyitems(None, [interpreted, plain])
    assert (interpreted.get_closest_marker("skip") is not None) == cuda
    assert plain.get_closest_marker("skip") is None
