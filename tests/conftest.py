import multiprocessing
import os

import pytest

from tests import harness


def _memfd_regions():
    """File descriptors of this process that are our memfd regions (`SharedRegion`)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:mep_region"):
                found.add(int(fd))
        except OSError:
            pass  # closed meanwhile (e.g. the listing's own descriptor)
    return found


def pytest_sessionfinish(session, exitstatus):
    harness.close_all()
    left = [child.pid for child in multiprocessing.active_children()]
    if left:
        raise RuntimeError(f"child processes left running after the tests: {left}")


@pytest.fixture(autouse=True)
def _no_leaked_regions():
    """Every test must close the memfd regions it made in this process (rank processes end with their cluster)."""
    before = _memfd_regions()
    yield
    leaked = _memfd_regions() - before
    assert not leaked, f"memfd regions left open by the test process: fds {sorted(leaked)}"
