"""The inference tests run one-token target forwards in Python loops; on a shared 2-core machine intra-op threading
only adds contention at these sizes, so they run single-threaded. Helpers live in ``inference_helpers``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
