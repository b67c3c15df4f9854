"""GPU tests: they run wherever a GPU is present and skip, saying why, only where none is (gpu_presence.py);
where one is present but fmha_rt cannot use it, each test fails with the reason."""
import pytest

from gpu_presence import FAILURE, SKIP_REASON


def pytest_collection_modifyitems(config, items):
    if SKIP_REASON:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(autouse=True)
def usable_gpu():
    if FAILURE:
        pytest.fail(FAILURE, pytrace=False)
