"""Shared fixtures of the checkpoint tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    """Small tensors: torch's thread pool only adds sync cost (large on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
