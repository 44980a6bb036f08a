import os

import pytest

from tests import harness


def pytest_sessionfinish(session, exitstatus):
    harness.close_all()


@pytest.fixture(autouse=True)
def _no_leaked_segments():
    """Every test must leave /dev/shm as it found it (segments are unlinked once mapped)."""
    before = {name for name in os.listdir("/dev/shm") if name.startswith("mep_")}
    yield
    after = {name for name in os.listdir("/dev/shm") if name.startswith("mep_")}
    leaked = after - before
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"
