import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Stage processes run with one torch thread in these tests; so does the reference."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
