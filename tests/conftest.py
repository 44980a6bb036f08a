import multiprocessing
import os

import pytest

from tests import harness

# Test tiers (issue 24 item 7): every test of a file gets its file's markers, from this one table.
# The README's command runs everything; the fast inner loop is `-m "not slow and not multihost"`.
TIERS = {
    # starts rank or agent processes (seconds per test)
    "slow": {"test_cuda", "test_cuda_emulated", "test_dropin", "test_elastic", "test_eplb_online", "test_faults",
             "test_hosts", "test_hosts_eplb", "test_launch_security", "test_membership_faults", "test_memory_bench",
             "test_models_serve", "test_partition", "test_peer_watch", "test_readmit_regions", "test_switch_faults",
             "test_te_endpoint", "test_cuda_build", "test_demo", "test_soak_bench", "test_deep_ep_compat",
             "test_misuse", "test_buffer", "test_simulate_cli", "test_models_demo", "test_elastic_buffer",
             "test_elastic_buffer_faults", "test_store_stall", "test_eplb_fault_routing", "test_eplb_coverage", "test_observability",
             "test_observability_faults"},
    # kills, stops or cuts off a process or a link
    "faults": {"test_faults", "test_membership_faults", "test_switch_faults", "test_partition", "test_peer_watch",
               "test_te_endpoint", "test_readmit_regions", "test_eplb_online", "test_hosts_eplb",
               "test_elastic_buffer_faults", "test_store_stall", "test_eplb_fault_routing",
               "test_eplb_coverage", "test_observability_faults"},
    # pretend hosts in network namespaces (root, ip, tc)
    "multihost": {"test_hosts", "test_hosts_eplb", "test_faults", "test_partition", "test_elastic_buffer_faults"},
    # runs only where a CUDA device is (skipped elsewhere, never failed)
    "gpu": {"test_cuda", "test_cuda_sim"},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        for marker, modules in TIERS.items():
            if module in modules:
                item.add_marker(getattr(pytest.mark, marker))


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
