"""Fixtures for the model tests; the tolerance table is in `model_checks.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # `import naive_k3` under any pytest import mode


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tests run thousands of tiny ops; intra-op threads only add barrier waits, which grow
    to milliseconds when other jobs share the 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
