"""Shared by every CPU test: workspaces the shim kept for a stand-in runtime (fake_gpu.py) are its host
memory, reached through its callbacks, so they are released while the test's patches keep it alive."""
import pytest

import fmha_rt


@pytest.fixture(autouse=True)
def release_kept_workspaces(monkeypatch):
    """Requests monkeypatch so that its undo (which drops a test's stand-in) runs after the release."""
    yield
    fmha_rt.release_workspaces()
