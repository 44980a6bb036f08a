import multiprocessing
import os

import pytest

from tests import harness

# Test tiers (issue 24 item 7): every test of a file gets its file's markers, from this one table.
# The README's command runs everything; the fast inner loop is `-m "not slow and not multihost"`.
TIERS = {
    # starts rank or agent processes (seconds per test)
    "slow": {"test_hosts_etcd", "test_etcd_ballots", "test_cuda", "test_cuda_emulated", "test_dropin", "test_elastic", "test_eplb_online", "test_faults",
             "test_hosts", "test_hosts_eplb", "test_launch_security", "test_membership_faults", "test_memory_bench",
             "test_models_serve", "test_partition", "test_peer_watch", "test_readmit_regions", "test_switch_faults",
             "test_te_endpoint", "test_cuda_build", "test_demo", "test_soak_bench", "test_deep_ep_compat",
             "test_misuse", "test_buffer", "test_simulate_cli", "test_models_demo", "test_elastic_buffer",
             "test_elastic_buffer_faults", "test_store_stall", "test_eplb_fault_routing", "test_eplb_coverage", "test_observability",
             "test_observability_faults", "test_elastic_barrier", "test_shrink", "test_drain",
             "test_combine_bias", "test_grow", "test_fallback_replacement", "test_hosts_resize",
             "test_grow_faults", "test_switch_after_resize", "test_grow_after_shrink", "test_group_wait"},
    # kills, stops or cuts off a process or a link
    "faults": {"test_hosts_etcd", "test_etcd_ballots", "test_faults", "test_membership_faults", "test_switch_faults", "test_partition", "test_peer_watch",
               "test_te_endpoint", "test_readmit_regions", "test_eplb_online", "test_hosts_eplb",
               "test_elastic_buffer_faults", "test_store_stall", "test_eplb_fault_routing",
               "test_eplb_coverage", "test_observability_faults", "test_etcd_store", "test_shrink", "test_drain",
               "test_grow", "test_fallback_replacement", "test_hosts_resize", "test_grow_faults",
               "test_grow_after_shrink", "test_group_wait"},
    # pretend hosts in network namespaces (root, ip, tc)
    "multihost": {"test_hosts_etcd", "test_hosts", "test_hosts_eplb", "test_faults", "test_partition", "test_elastic_buffer_faults",
                  "test_hosts_resize"},
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


@pytest.fixture(scope="session")
def etcd_installed():
    """Skip the test where Debian's etcd-server or the etcd3gw client is missing (scripts/install.sh
    installs both), except under CI, where it fails."""
    import shutil

    try:
        import etcd3gw  # noqa: F401
        missing = None if shutil.which("etcd") else "etcd (Debian's etcd-server)"
    except ImportError:
        missing = "the etcd3gw client (pip install -e '.[etcd]')"
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{missing} is not installed: scripts/install.sh installs it")
        pytest.skip(f"{missing} is not installed: scripts/install.sh installs it")


@pytest.fixture(scope="session")
def _etcd_session_cluster(etcd_installed):
    """A 3-member etcd cluster on loopback ports (data on /dev/shm), started once for the session.
    Skipped as `etcd_installed` says."""
    from mooncake_ep_switch.store import LocalEtcdCluster

    with LocalEtcdCluster(3, data_root="/dev/shm" if os.path.isdir("/dev/shm") else None, heartbeat_ms=50,
                          election_ms=500) as cluster:  # a new leader within ~0.5-1 s of a kill
        yield cluster


@pytest.fixture
def etcd_cluster(_etcd_session_cluster):
    """The session's etcd cluster with every member running and seeing a leader when the test starts.

    Tests that kill or stop a member restore it before they end, but a member resumed or restarted may
    still be electing a leader (it answers 503) when the next test begins: wait for that here.
    """
    cluster = _etcd_session_cluster
    for index, process in enumerate(cluster.processes):
        if process is None or process.poll() is not None:
            cluster.kill(index)  # reaps an exited member (nothing when none runs)
            cluster.restart(index)
    cluster.wait_healthy(range(len(cluster.processes)), 30.0)
    yield cluster
