"""GPU tests: they run wherever a GPU is visible and skip, saying why, only where none is."""
import pytest

from fmha_rt.runtime import backend
from fmha_rt.errors import FmhaError


def _gpu_reason():
    try:
        rt = backend.runtime()
    except FmhaError as exc:
        return f"no GPU runtime: {exc}"
    return None if rt.devices else f"no GPU device ({rt.backend} runtime {rt.library} sees none)"


SKIP_REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if SKIP_REASON:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
