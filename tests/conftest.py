"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture
def single_thread():
    """One torch thread: for tiny ops, thread start-up costs more than it saves on a shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
