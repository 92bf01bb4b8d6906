"""Shared fixtures."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Engine runs on tiny shapes are faster on one thread, and do not suffer from a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
