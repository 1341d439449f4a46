import pytest

from tests.helpers import CORPUS


@pytest.fixture(scope="package")
def calib_text(tmp_path_factory):
    f = tmp_path_factory.mktemp("calib") / "calib.txt"
    f.write_text("\n".join(CORPUS * 10) + "\n")
    return f


@pytest.fixture(scope="package")
def tiny4(tmp_path_factory):
    """(directory, model, tokenizer): a tiny untied Llama with four layers."""
    from tests.helpers import write_hf_dir

    path = tmp_path_factory.mktemp("tiny4")
    model, tok = write_hf_dir(path, seed=3, tie=False, layers=4)
    return path, model, tok
