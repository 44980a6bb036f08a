"""The ElasticBuffer called as DeepEP V2's own test program calls it (issue 42): its constructor and
dispatch flags as the ints its argparse gives (`--do-cpu-sync`, `--allow-hybrid-mode`,
`--allow-multiple-reduction`, `--prefer-overlap-with-compute`, `--deterministic`), both of its scenario
flag sets, `do_handle_copy` 1 and 0, and its combine of the expanded handle without weights when
multiple reductions are not allowed; R=2 and R=4 on shared memory, the Transfer Engine and the
collective fallback. Every output bit for bit against tests/elastic_reference.py (V2's semantics:
`allow_multiple_reduction=0` sums every top-k entry on the owner from the bias, in top-k order, fp32,
once). The grid itself is tests/test_elastic_buffer.py's `rank_v2_grid` (V2's call pattern).
"""
import pytest

from tests import harness
from tests.test_elastic_buffer import rank_v2_grid

# V2's program: its default scenario, and the one its README runs second; each with --deterministic.
SCENARIOS = {
    "default": dict(do_cpu_sync=1, allow_hybrid_mode=1, allow_multiple_reduction=1, prefer_overlap_with_compute=0),
    "no-cpu-sync-one-reduction": dict(do_cpu_sync=0, allow_hybrid_mode=1, allow_multiple_reduction=0,
                                      prefer_overlap_with_compute=0),
}


@pytest.mark.parametrize("deterministic", [0, 1])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("num_ranks", [2, 4])
@pytest.mark.parametrize("transport", ["shm", "mooncake", "collective"])
def test_v2_program_scenarios_are_exact(transport, num_ranks, scenario, deterministic):
    """Both scenarios of V2's program (flags as ints), with and without --deterministic: every case exact."""
    flags = dict(SCENARIOS[scenario], deterministic=deterministic)
    E = 8 * num_ranks // 2
    values = harness.run(num_ranks, rank_v2_grid, transport, 12, 256, 6, E, 17 + deterministic, None, 2, flags,
                         timeout_s=400)
    assert all(value["cases"] == 24 and value["received"] > 0 for value in values), values
