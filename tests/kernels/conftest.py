"""What the kernel tests share: the C++ module must build here (a missing compiler fails them, not skips them), and
each kernel runs on one thread and on two (torch's loops split work, and sometimes round, by thread count)."""

import pytest
import torch

from hybridflow.kernels import build


@pytest.fixture(scope="module", autouse=True)
def built():
    assert build.available(), build.unavailable_reason()


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
