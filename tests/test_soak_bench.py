"""Smoke test of the soak benchmark (mooncake_ep_switch/bench/soak.py) at tiny round counts.

The full soak (10^4 shm rounds, 10^3 over the Transfer Engine) is a benchmark, not a test: see
docs/benchmarks.md. Here: the CLI runs end to end on both transports in a few seconds, every printed
and written figure is well-formed, every exact check passes, and the verdict flags what it must.
"""
import json

import pytest

from mooncake_ep_switch.bench import soak
from mooncake_ep_switch.buffer.transport.select import transfer_engine_available as _transfer_engine_available

SAMPLE_KEYS = {"round", "rss_kib", "anon_kib", "file_kib", "shmem_kib", "malloc_used_kib", "malloc_free_kib", "fds",
               "py_threads", "threads", "store_workers", "shm_handles", "pool_bytes", "py_objects", "dev_shm", "traced_kib"}


def test_soak_cli_runs_both_transports_with_wellformed_figures(tmp_path, capsys):
    if not _transfer_engine_available():
        pytest.skip("mooncake Transfer Engine not installed")
    out = tmp_path / "soak.json"
    # Tiny runs have not warmed up: a large RSS tolerance; fds, threads and checks stay strict.
    status = soak.main(["--rounds-shm", "40", "--rounds-te", "20", "--hidden", "256", "--tokens", "32",
                        "--samples", "4", "--check-every", "5", "--warmup-min", "0", "--rss-tol-mib", "1000",
                        "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert [r["config"]["transport"] for r in report["reports"]] == ["shm", "mooncake"]
    for entry, rounds in zip(report["reports"], (40, 20)):
        assert entry["num_ranks"] == 2 and len(entry["ranks"]) == 2
        for rank in entry["ranks"]:
            result, judged = rank["result"], rank["verdict"]
            assert result["transport"] == entry["config"]["transport"]
            samples = result["samples"]
            assert all(set(s) == SAMPLE_KEYS for s in samples + [result["after_destroy"]])
            # before the Buffer, when made, then every rounds // 4 rounds up to the last one
            assert [s["round"] for s in samples] == [0, 0] + list(range(rounds // 4, rounds + 1, rounds // 4))
            for s in samples:
                assert s["rss_kib"] > 0 and s["anon_kib"] > 0 and s["fds"] > 0 and s["threads"] >= s["py_threads"] >= 1
                assert s["malloc_used_kib"] > 0
            assert samples[-1]["shm_handles"] > 0 and result["after_destroy"]["shm_handles"] == 0
            assert result["threads_left"] == []  # names any Python thread that outlived destroy()
            assert result["after_destroy"]["py_threads"] == samples[0]["py_threads"]
            checks = result["checks"]
            assert sum(checks.values()) == rounds // 5
            assert min(checks.values()) >= 1  # every mode checked
            assert result["failure_count"] == 0 and result["failures"] == []
            seconds = result["round_seconds"]
            assert 0 < seconds["median"] <= seconds["p99"] <= seconds["max"] < 60
            assert judged["ok"] and judged["problems"] == [] and judged["rounds_per_s"] > 0
            # TE's connection pool may open another connection later in a run (a write submitted before
            # the previous one returned its connection, under load): within its allowance, never on shm.
            assert 0 <= judged["growth"]["fds"] <= soak.te_pool_fds(result) and judged["growth"]["threads"] == 0
    for transport in ("shm", "mooncake"):
        for rank in (0, 1):
            assert f"verdict {transport} rank {rank}: FLAT" in printed
    assert "| round | RSS MiB |" in printed and "| destroyed |" in printed
    assert "every transport and rank flat after warm-up, every check exact" in printed


def _result(rounds, values, transport="shm"):
    samples = [dict.fromkeys(SAMPLE_KEYS, 0) for _ in range(len(values) + 1)]
    samples[0]["round"] = 0
    for s, (index, rss, fds) in zip(samples[1:], values):
        s.update({"round": index, "rss_kib": rss, "fds": fds})
    return {"samples": samples, "failure_count": 0, "failures": [], "loop_seconds": 1.0, "transport": transport,
            "num_ranks": 2, "round_seconds": {"median": 0.001, "p99": 0.002, "max": 0.003}}


@pytest.mark.parametrize("values, ok, problem", [
    ([(0, 100_000, 9), (10, 100_000, 9), (20, 101_000, 9), (30, 101_500, 9)], True, None),
    ([(0, 100_000, 9), (10, 100_000, 9), (20, 103_000, 9), (30, 103_100, 9)], False, "RSS grew"),
    ([(0, 100_000, 9), (10, 100_000, 9), (20, 100_000, 10), (30, 100_000, 10)], False, "open fds"),
    ([(0, 50_000, 5), (10, 100_000, 9), (20, 100_500, 9), (30, 100_000, 9)], True, None),  # warm-up ignored
])
def test_soak_verdict_flags_growth_after_warmup(values, ok, problem):
    config = soak.SoakConfig("shm", 30, 8, 128, 4, 2, 10, 10, 0.3, 0, warmup_min=0)
    judged = soak.verdict(_result(30, values), config, rss_tol_mib=2.0, rss_tol_pct=1.0)
    assert judged["baseline_round"] == 10
    assert judged["ok"] is ok
    if problem:
        assert any(problem in p for p in judged["problems"]), judged["problems"]


@pytest.mark.parametrize("last_fds, ok", [(35, True), (34 + soak.TE_POOL_FDS_PER_PEER, True),
                                           (35 + soak.TE_POOL_FDS_PER_PEER, False)])
def test_soak_verdict_allows_the_transfer_engine_pool_only(last_fds, ok):
    """Over TE the open fds may step up by the connection pool's allowance (noted), not more; on shm not at all."""
    values = [(0, 100_000, 34), (10, 100_000, 34), (20, 100_000, 34), (30, 100_000, last_fds)]
    config = soak.SoakConfig("mooncake", 30, 8, 128, 4, 2, 10, 10, 0.3, 0, warmup_min=0)
    judged = soak.verdict(_result(30, values, "mooncake"), config, rss_tol_mib=2.0, rss_tol_pct=1.0)
    assert judged["ok"] is ok, judged
    assert bool(judged["notes"]) is ok and any("open fds" in p for p in judged["problems"]) is (not ok)
    shm = soak.verdict(_result(30, values, "shm"), soak.SoakConfig("shm", 30, 8, 128, 4, 2, 10, 10, 0.3, 0,
                                                                   warmup_min=0), rss_tol_mib=2.0, rss_tol_pct=1.0)
    assert not shm["ok"]


@pytest.mark.parametrize("threads, workers, ok, problem", [
    ((5, 5, 3, 3), (2, 2, 0, 0), True, None),  # idle store workers ended mid-run (a slow round under load)
    ((5, 5, 6, 6), (2, 2, 2, 2), False, "Python threads"),  # another thread appeared
    ((6, 6, 6, 6), (3, 3, 3, 3), False, "store worker threads"),  # past the bound of a Buffer's store
])
def test_soak_verdict_judges_threads_without_the_store_workers(threads, workers, ok, problem):
    """Threads are judged without the store clients' workers (made on demand, ended when idle); those have a bound."""
    result = _result(30, [(0, 100_000, 9), (10, 100_000, 9), (20, 100_000, 9), (30, 100_000, 9)])
    for s, count, store in zip(result["samples"][1:], threads, workers):
        s.update({"py_threads": count, "threads": count + 4, "store_workers": store})
    config = soak.SoakConfig("shm", 30, 8, 128, 4, 2, 10, 10, 0.3, 0, warmup_min=0)
    judged = soak.verdict(result, config, rss_tol_mib=2.0, rss_tol_pct=1.0)
    assert judged["ok"] is ok, judged
    if problem:
        assert any(problem in p for p in judged["problems"]), judged["problems"]
    else:
        assert judged["growth"]["threads"] == 0 and any("store worker" in n for n in judged["notes"]), judged


def test_bench_cli_dispatches_soak(capsys):
    from mooncake_ep_switch.apps.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["bench", "soak", "--help"])
    assert stop.value.code == 0
    assert "--rounds-shm" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        soak.main(["--hidden", "100"])
    assert stop.value.code == 2
    assert "--hidden: expected a multiple of 128, got 100" in capsys.readouterr().err


def test_soak_check_detects_a_wrong_row_count_row_or_sum():
    import torch

    config = soak.SoakConfig("shm", 10, 8, 128, 4, 2, 1, 1, 0.1, 3)
    counts = soak._token_counts(config.tokens)
    pools = [soak._token_pool(0, config)]
    x, topk, weights = soak._round_inputs(0, 5, config, pools[0], counts)
    recv_x = torch.zeros((4, config.tokens, config.hidden), dtype=torch.bfloat16)
    recv_count = torch.zeros(4, dtype=torch.int32)
    for expert in range(4):  # one rank: every expert is local; rows in token order
        rows = [x[t] for t in range(x.size(0)) if expert in topk[t].tolist()]
        recv_count[expert] = len(rows)
        if rows:
            recv_x[expert, :len(rows)] = torch.stack(rows)
    combined = torch.zeros_like(x)
    for t in range(x.size(0)):
        total = torch.zeros(config.hidden)
        for k in range(config.top_k):
            if topk[t, k] >= 0:
                total += weights[t, k] * x[t].float()
        combined[t] = total.to(torch.bfloat16)
    active = torch.ones(1, dtype=torch.int32)
    check = lambda rx, rc, out, act=active: soak._check_round(0, 1, 5, config, pools, counts, rx, rc, out, act)
    assert check(recv_x, recv_count, combined) is None
    busy = int(recv_count.argmax())
    wrong_count = recv_count.clone()
    wrong_count[busy] -= 1
    assert check(recv_x, wrong_count, combined).startswith(f"recv_count[{busy}]")
    wrong_rows = recv_x.clone()
    wrong_rows[busy, 0, 3] += 1
    assert check(wrong_rows, recv_count, combined).startswith(f"recv_x[{busy}]: row 0")
    wrong_sum = combined.clone()
    wrong_sum[1, 0] += 64  # |sums| <= 16: always a different bf16
    assert "combined: token 1" in check(recv_x, recv_count, wrong_sum)
    assert "marked inactive" in check(recv_x, recv_count, combined, torch.zeros(1, dtype=torch.int32))


def test_bench_cli_passes_leading_flags_to_the_benchmark(capsys):
    """`mooncake-ep bench --quick` reaches the benchmark's own parser (argparse's REMAINDER dropped a
    leading flag: "unrecognized arguments", exit 2)."""
    from mooncake_ep_switch.apps.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["bench", "--quick", "--help"])
    assert stop.value.code == 0
    assert "usage: python -m mooncake_ep_switch.bench [-h] [--quick]" in capsys.readouterr().out
