"""`bench recovery` (apps/recovery_bench.py, issue 36): the demo settings of each kind of replacement and the
table's columns, in one process (the runs themselves are the demo's, tested in tests/test_demo.py)."""
import pytest

from mooncake_ep_switch.apps import recovery_bench
from mooncake_ep_switch.apps.demo_kills import plan_kills
from mooncake_ep_switch.apps.demo_ranks import request_trace


@pytest.mark.parametrize("quick", [False, True])
def test_each_kind_kills_one_rank_inside_the_burst_and_covered_gives_every_expert_two_copies(quick, tmp_path):
    for kind in recovery_bench.KINDS:
        config = recovery_bench.demo_config(kind, quick, str(tmp_path), "etcd")
        kills = plan_kills(config, request_trace(config))  # refuses a kill step outside the burst
        assert [(k.step, k.covered) for k in kills] == [(config.kill_step, kind == "covered")], kind
        assert config.store == "etcd" and config.num_ranks == (2 if quick else 4)
    covered = recovery_bench.demo_config("covered", quick, str(tmp_path))
    # Case (a): every expert of any rank has a copy on another rank (the demo's redundant slots hold the next rank's
    # experts), and the survivors serve steps without the rank before its replacement comes.
    assert covered.redundant_per_rank * covered.num_ranks == covered.experts and covered.replace_after >= 2
    assert covered.replacement == "forked"
    with pytest.raises(ValueError, match=r"^kind: expected one of spawn, forked, standby, coverage, covered, got 'x'$"):
        recovery_bench.demo_config("x", quick, str(tmp_path))


def _row(kind, covered, coverage_s, lost):
    recovery = {"detection_s": 0.1, "interruption_s": 1.5, "replacement_s": 0.4, "covered": covered,
                "death_to_full_coverage_s": coverage_s, "restored": {"from_peers": 12, "from_loader": 0},
                "phases": [{"phase": "detection", "seconds": 0.1}], "in_advance": []}
    return {"kind": kind, "ranks": 4, "recovery": recovery, "lost": lost, "correct": True}


def test_table_says_full_coverage_was_never_lost_in_case_a_and_gives_the_epoch_or_first_full_step_else():
    lines = recovery_bench.table([_row("covered", True, None, [53, 0, 0, 0]), _row("coverage", False, 0.321, [9, 0]),
                                  _row("forked", False, None, [147, 0])]).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    column = header.index("death -> full coverage")
    assert [c[column] for c in cells] == ["0 ms (live copies)", "321 ms", "1500 ms"]  # else: the first full step
    assert [c[header.index("detection")] for c in cells] == ["100 ms"] * 3
    assert cells[0][-1] == "53, 0, 0, 0"
