import pytest
import torch


@pytest.fixture
def one_thread():
    """One torch thread: on a shared 2-core machine two threads per op make timings erratic and slow."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
