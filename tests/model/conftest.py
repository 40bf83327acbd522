import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The test machine's cores are shared; oversubscribed OpenMP threads are several times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
