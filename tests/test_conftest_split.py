"""The root conftest skips tests that interpret Triton on CPU tensors where CUDA is present (and only there), and
puts the files that hold integration tests first."""
import pytest
import torch

from tests.conftest import integration_files_first, pytest_collection_modifyitems


class _Item:
    def __init__(self, marked: bool, nodeid: str = "tests/test_x.py::test_x", integration: bool = False):
        self.marks = [pytest.mark.interpreted_triton.mark] if marked else []
        self.marks += [pytest.mark.integration.mark] if integration else []
        self.nodeid = nodeid

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


def test_files_with_an_integration_test_come_first_each_file_kept_together_in_order():
    items = [_Item(False, "tests/a.py::t1"), _Item(False, "tests/slow.py::t1"),
             _Item(False, "tests/slow.py::t2", integration=True), _Item(False, "tests/b.py::t1"),
             _Item(False, "tests/slow2.py::t1", integration=True), _Item(False, "tests/a.py::t2")]
    integration_files_first(items)
    assert [i.nodeid for i in items] == ["tests/slow.py::t1", "tests/slow.py::t2", "tests/slow2.py::t1",
                                         "tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2"]
