"""Resident memory of a Buffer (issue 28 item 9): the benchmark's per-rank sample, and what it must show.

Over the Transfer Engine the staging copy of the region used to be written in full at construction
(`torch.zeros`), so a rank kept a whole region resident (1.13x the 3.19 GB region at DeepEP's shape):
only the pages a round touches may be resident. The full table is `python -m mooncake_ep_switch.bench
memory` (docs/benchmarks.md); here the quick shape, 2 ranks.
"""
import pytest

from mooncake_ep_switch.bench import memory
from mooncake_ep_switch.launcher.launch import check_outcomes
from tests import harness


@pytest.mark.parametrize("transport", ["mooncake", "shm"])
def test_a_buffer_keeps_only_the_pages_it_uses_resident(transport):
    with harness.fresh_cluster(2) as cluster:
        samples = check_outcomes(cluster.run(memory.rank_memory, transport, memory.QUICK, timeout_s=300))
    for sample in samples:
        region = sample["region"]
        assert region > 100e6, sample  # a region large enough that touching all of it shows
        assert sample["built"] - sample["before"] < 0.02 * region, sample  # the constructor touches ~nothing
        # one round touches the rows it moves (and the output pool keeps its outputs): far below the region
        assert sample["dropped"] - sample["before"] < 0.5 * region, sample


def test_memory_table_names_every_transport():
    row = {"transport": "mooncake", "requested": "mooncake", "shape": "R=2", "region": 1000, "before": 10,
           "built": 11, "dispatched": 60, "combined": 70, "dropped": 65, "outputs": 40}
    table = memory.format_table([row, dict(row, transport="collective", requested="collective", region=0)])
    assert "| mooncake (disable_p2p: TE to every peer) | R=2 | 0 | 0.0 | 0.055x |" in table
    assert "| collective | R=2 | 0 | 0.0 | - |" in table
