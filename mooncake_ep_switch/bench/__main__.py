"""`python -m mooncake_ep_switch.bench`: transport, switch and EPLB benchmarks with ratios to in-run baselines.

Subcommands (each takes `--help`): soak, elastic, memory, membership, hosts; `--device cuda` for the GPU rows; none for the
table below (`--quick`, `--out FILE`). Also `mooncake-ep bench ...`.

Rows:
  * collective fallback vs an all-gather + all-reduce implementation (R=4 T=128 H=1024 E=32 K=8),
    and the floor: the fallback's exchanges alone with the same bytes;
  * shm vs collective vs TE per-rank bandwidth against a single-core memcpy of one rank's bytes
    (R=2 T=128 H=7168 E=32 K=8; DeepEP's convention: never summed over ranks);
  * shm vs collective speed (R=4 T=128 H=1024 E=32 K=8), and the floor: the round's logical bytes
    copied once on all cores;
  * small-message round trip (dispatch + combine) at T=1 H=1024, R=2;
  * EPLB placement against the in-repo classic greedy (`eplb_bench`, 8 layers per configuration);
  * TP<->EP switch: weight reshard and KV redistribution against memcpy and the collective
    (`switch_bench`; the small shapes with `--quick`).
`python -m mooncake_ep_switch.bench soak [...]` runs the soak benchmark instead (`bench.soak`: 10^4
dispatch + combine rounds over shm and 10^3 over the Transfer Engine, resources sampled; `soak --help`).
`python -m mooncake_ep_switch.bench --device cuda [...]` runs the GPU rows instead (`bench.cuda_bench`:
the "cuda" transport against a device-to-device copy, eager and from a CUDA graph, the CPU shm figure beside).
`python -m mooncake_ep_switch.bench memory [--quick]` prints a rank's resident memory per transport
(`bench.memory`: what the Buffer keeps resident against its region, apart from the caller's tensors).
`python -m mooncake_ep_switch.bench elastic [--quick]` compares DeepEP V2's `ElasticBuffer` with the legacy Buffer
on the same tokens and routing (`bench.elastic_bench`: shm, Transfer Engine and collective, per rank against one
core's memcpy).
`python -m mooncake_ep_switch.bench membership [--quick] [--ranks 8,16]` drives the membership control plane
alone (`bench.membership_bench`: ranks as threads on one TCPStore, no data plane): time and store operations
to agree on a view after a death and to admit a joiner, R=8..256.
`python -m mooncake_ep_switch.bench store [--quick] [--ranks 8]` compares the TCPStore with an etcd cluster it
starts (`bench.store_bench`: each store operation's latency, a view after a death and a replacement's admission).
`python -m mooncake_ep_switch.bench hosts [...]` runs the cross-host benchmark (`bench.hosts`: two
network namespaces, Transfer Engine vs the gloo collective over the same veths vs shm on one host,
bytes on the wire against the routed bytes; needs root).
Timing of the transport rows: per rank, the median over 5 barrier-separated batches of the batch's mean time per round; the
slowest rank counts. Every ratio uses numbers from this run.
"""
import sys

from mooncake_ep_switch.bench import transport as tb
from mooncake_ep_switch.launcher.launch import LocalCluster
from mooncake_ep_switch.bench.table import run_table_cli


def _progress(index: int, total: int, label: str) -> None:
    print(f"[{index}/{total}] {label}", file=sys.stderr, flush=True)


def run_transport_rows(quick: bool = False) -> list:
    """Measure every transport row; returns a list of dict rows.

    Starts local clusters (2 and 4 ranks) in turn and runs the quick EPLB rows too; progress goes to stderr.

    Arguments:
        quick: fewer iterations (5 instead of 20 per batch, fewer for the slow transports).

    Returns:
        rows: list of dict in the `table.format_rows` shape (benchmark, shape, ours_ms, baseline,
            baseline_ms, speedup, optional note).
    """
    iters = 5 if quick else 20
    rows = []
    total = 6
    _progress(1, total, "collective vs all-gather + all-reduce, R=4")
    rows += tb.fallback_vs_allgather(iters=iters)

    _progress(2, total, "bandwidth: shm vs collective vs memcpy, R=2 hidden=7168")
    shape = tb.TransportShape(2, 128, 7168, 32, 8)
    with LocalCluster(shape.num_ranks) as cluster:
        shm = tb.measure(cluster, "shm", shape, iters)
        coll = tb.measure(cluster, "collective", shape, max(3, iters // 4))
        te = tb.measure(cluster, "mooncake", shape, max(3, iters // 4))
    per_rank = shm["rank_selections"] * shape.hidden * 2 * 2  # one rank's dispatch + combine bytes
    memcpy = tb.memcpy_rank_seconds(per_rank)
    label = f"R=2 T=128 hidden=7168 E=32 K=8 ({per_rank / 1e6:.1f} MB per rank)"
    for name, result in (("shm", shm), ("collective", coll), ("mooncake TE (tcp, disable_p2p)", te)):
        gbps = per_rank / result["seconds"] / 1e9
        rows.append({"benchmark": f"{name} dispatch+combine bandwidth per rank (bf16)", "shape": label,
                     "ours_ms": result["seconds"] * 1e3, "baseline": "1-core memcpy of one rank's bytes",
                     "baseline_ms": memcpy * 1e3, "speedup": memcpy / result["seconds"],
                     "note": f"{gbps:.2f} GB/s per rank, memcpy {per_rank / memcpy / 1e9:.2f} GB/s"})

    rows.append({"benchmark": "mooncake TE dispatch+combine (bf16, tcp loopback)", "shape": label,
                 "ours_ms": te["seconds"] * 1e3, "baseline": "shm (same shape, same run)",
                 "baseline_ms": shm["seconds"] * 1e3, "speedup": shm["seconds"] / te["seconds"],
                 "note": f"collective / TE time: {coll['seconds'] / te['seconds']:.2f}x"})

    _progress(3, total, "speed: shm vs collective, R=4 hidden=1024")
    shape = tb.TransportShape(4, 128, 1024, 32, 8)
    with LocalCluster(shape.num_ranks) as cluster:
        shm = tb.measure(cluster, "shm", shape, iters)
        coll = tb.measure(cluster, "collective", shape, iters)
    rows.append({"benchmark": "shm dispatch+combine (bf16)", "shape": "R=4 T=128 hidden=1024 E=32 K=8",
                 "ours_ms": shm["seconds"] * 1e3, "baseline": "collective fallback",
                 "baseline_ms": coll["seconds"] * 1e3, "speedup": coll["seconds"] / shm["seconds"]})
    logical = shm["selections"] * shape.hidden * 2 * 2
    floor = tb.copy_floor_seconds(logical)
    rows.append({"benchmark": "floor: copy the round's logical bytes once on all cores", "shape":
                 f"R=4 T=128 hidden=1024 E=32 K=8 ({logical / 1e6:.1f} MB logical)", "ours_ms": floor * 1e3,
                 "baseline": "collective fallback", "baseline_ms": coll["seconds"] * 1e3,
                 "speedup": coll["seconds"] / floor,
                 "note": "the most any copying transport could beat the fallback by on this machine"})

    _progress(4, total, "latency: T=1 round trip, R=2")
    shape = tb.TransportShape(2, 1, 1024, 32, 8)
    with LocalCluster(shape.num_ranks) as cluster:
        shm = tb.measure(cluster, "shm", shape, 200 if not quick else 50, warmup=20)
        coll = tb.measure(cluster, "collective", shape, 50 if not quick else 10, warmup=5)
    rows.append({"benchmark": "T=1 round trip dispatch+combine (bf16)", "shape": "R=2 T=1 hidden=1024 E=32 K=8",
                 "ours_ms": shm["seconds"] * 1e3, "baseline": "collective fallback",
                 "baseline_ms": coll["seconds"] * 1e3, "speedup": coll["seconds"] / shm["seconds"],
                 "note": f"shm round trip {shm['seconds'] * 1e6:.0f} us"})
    _progress(5, total, "EPLB placement vs classic greedy (quick)")
    from mooncake_ep_switch.bench import eplb_bench

    for row in eplb_bench.run(quick=True):
        rows.append(_eplb_row(row))
    return rows


def _eplb_row(row: dict) -> dict:
    """One EPLB benchmark row in the common table shape (ratios against the in-repo greedy)."""
    note = f"balancedness {row['bal_ours']:.4f} vs greedy {row['bal_greedy']:.4f}"
    if "moved_ours" in row:
        note += (f"; moved copies {100 * row['moved_ours']:.1f}% vs {100 * row['moved_greedy']:.1f}% of slots"
                 f"; {row['worst_drop']:.4f} below a fresh placement")
    return {"benchmark": f"EPLB placement {row['workload']}", "shape": f"{row['config']} ({row['layers']} layers)",
            "ours_ms": row["t_ours"] * 1e3, "baseline": "classic greedy (in-repo)", "baseline_ms": row["t_greedy"] * 1e3,
            "speedup": row["t_greedy"] / row["t_ours"], "note": note}


def _take_device(argv: list) -> str:
    """Remove `--device cpu|cuda` from `argv`; returns the device ("cpu" when not given)."""
    for index, value in enumerate(argv):
        if value == "--device" or value.startswith("--device="):
            choice = value.partition("=")[2] if "=" in value else (argv[index + 1] if index + 1 < len(argv) else "")
            if choice not in ("cpu", "cuda"):
                raise SystemExit(f"--device: expected 'cpu' or 'cuda', got {choice!r}")
            del argv[index:index + (1 if "=" in value else 2)]
            return choice
    return "cpu"


def main(argv=None) -> int:
    """Run every benchmark and print the markdown table (`python -m mooncake_ep_switch.bench`).

    Arguments:
        argv: command-line arguments (`--quick`, `--out FILE`, `--device cuda` for the GPU rows), or None for
            `sys.argv[1:]`; when the
            first is `soak` (or `hosts`, `memory`, `elastic`, `membership`, `store`), the rest go to that benchmark
            (`bench.soak.main`, `bench.hosts.main`, `bench.memory.main`, `bench.elastic_bench.main`,
            `bench.membership_bench.main`).

    Returns:
        status: int, 0 (failures raise); for `soak`, its status (1 when a check or the flatness
            verdict failed).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    device = _take_device(argv)
    if device == "cuda":
        from mooncake_ep_switch.bench import cuda_bench

        return cuda_bench.main(argv)
    if argv[:1] == ["soak"]:
        from mooncake_ep_switch.bench import soak

        return soak.main(argv[1:])
    if argv[:1] == ["hosts"]:
        from mooncake_ep_switch.bench import hosts

        return hosts.main(argv[1:])
    if argv[:1] == ["elastic"]:
        from mooncake_ep_switch.bench import elastic_bench

        return elastic_bench.main(argv[1:])
    if argv[:1] == ["memory"]:
        from mooncake_ep_switch.bench import memory

        return memory.main(argv[1:])
    if argv[:1] == ["store"]:
        from mooncake_ep_switch.bench import store_bench

        return store_bench.main(argv[1:])
    if argv[:1] == ["membership"]:
        from mooncake_ep_switch.bench import membership_bench

        return membership_bench.main(argv[1:])

    def rows_of(quick: bool) -> list:
        rows = run_transport_rows(quick=quick)
        from mooncake_ep_switch.bench import switch_bench

        _progress(6, 6, "TP<->EP switch: weights and KV vs memcpy")
        return rows + switch_bench.run(quick=quick)

    return run_table_cli("python -m mooncake_ep_switch.bench", __doc__, rows_of, argv)


if __name__ == "__main__":
    sys.exit(main())
