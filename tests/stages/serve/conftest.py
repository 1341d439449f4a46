import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Serve tests run many tiny ops: one torch thread is faster and steadier on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
