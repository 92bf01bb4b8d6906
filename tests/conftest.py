"""Shared fixtures, and how Triton runs: compiled on a GPU, under its interpreter without one.

Triton reads TRITON_INTERPRET once, when it is first imported; conftest is imported before any
test module (and so before anything imports minillm and, through it, Triton).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Engine runs on tiny shapes are faster on one thread, and do not suffer from a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
