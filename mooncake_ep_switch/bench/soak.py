"""Soak benchmark: many dispatch + combine rounds per transport, resources sampled, results checked.

`python -m mooncake_ep_switch.bench soak` (also `mooncake-ep bench soak`, or
`python -m mooncake_ep_switch.bench.soak`). Not a test: it runs 10^4 rounds at R=2 over shm and 10^3
over the Transfer Engine by default and prints what it measured.

Each transport gets a fresh `LocalCluster` of `--ranks` ranks and one `Buffer` per rank. Every rank
runs the rounds with seeded random routing (a new top-k, ~5 % of slots -1, weights k/16, and one of
four token counts per round) and cycles the call modes: synchronous, `async_finish` (wait on the
event) and `return_recv_hook` (call the hook), one in three each, so the output pool and the
background receive thread are soaked. The previous round's results are held while the next round
runs (two dispatch results alive at once, as an overlapped pipeline would).

Experts are the identity: the combine sends `recv_x` back. Token values are integers in [-8, 8] and
weights multiples of 1/16, so `sum_k w_k * x` is exact in float32 in any order and the combined
output must equal `bf16(sum_k w_k * x)` bit for bit. Every `--check-every` rounds the rank rebuilds
every source's inputs from the seeds and checks, exactly: `recv_count`, the valid rows of `recv_x`
(by source rank, then token), and the combined output. This reference shares no code with the
runtime.

`--samples` times per transport, evenly spaced over the rounds (after a round completed, nothing in flight), a
rank samples: VmRSS and
Threads from /proc/self/status, open fds (/proc/self/fd), Python threads (`threading.active_count`),
its shared-memory handles (fds and mappings of memfd or /dev/shm objects), the output pool's bytes,
the number of GC-tracked Python objects, and the machine-wide /dev/shm entry count (other processes
change it: information only).

Verdict, per transport and rank, over the samples after the warm-up (`--warmup-frac` of the rounds,
at least `--warmup-min`, at most half):
RSS growth (largest sample minus the first post-warm-up sample) at most `--rss-tol-mib` MiB or
`--rss-tol-pct` % of RSS, whichever is larger; open fds, Python threads, native threads and
shared-memory handles exactly constant; every check exact and no peer marked inactive. The exit
status is 1 when any of that fails.
"""
import argparse
import array
import collections
import gc
import json
import os
import sys
import threading
import time
import tracemalloc
from typing import List, NamedTuple, Optional

from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer.membership.store_deadline import IDLE_S

TIMEOUT_US = 60_000_000  # per call; a live peer never misses it, even on a loaded machine
X_POOL = 4  # distinct token tensors per rank, cycled
STORE_WORKER_PREFIX = "mep-store-"  # `BoundedStore`'s worker threads (store_deadline._Lane)
STORE_WORKERS_MAX = 2  # one Buffer's store: a call lane and a wait lane


class SoakConfig(NamedTuple):
    """Sizes and schedule of one soak run on one transport.

    Fields:
        transport: `"shm"`, `"mooncake"` (with `disable_p2p`: every peer over the Transfer Engine)
            or `"collective"`.
        rounds: dispatch + combine rounds.
        tokens: `T`, num_max_dispatch_tokens_per_rank (rounds use T, 3T/4, T/2 or T/4 tokens).
        hidden: `H`, a multiple of 128.
        experts: `E`, a multiple of the number of ranks.
        top_k: `K`.
        check_every: exact check of the outputs every this many rounds.
        sample_every: resource sample every this many rounds.
        warmup_frac: fraction of the rounds before the flatness baseline ...
        warmup_min: ... but at least this many rounds (at most half the rounds): over the Transfer
            Engine, glibc's malloc arenas reach their high-water mark only after ~250 rounds.
        seed: seed of the routing and the token values.
        trace: run `tracemalloc` (from the Buffer's creation on): samples get `traced_kib`, and the
            result the ten source lines whose Python allocations grew most after the warm-up.
    """

    transport: str
    rounds: int
    tokens: int
    hidden: int
    experts: int
    top_k: int
    check_every: int
    sample_every: int
    warmup_frac: float
    seed: int
    warmup_min: int = 300
    trace: bool = False


def warmup_rounds(config: SoakConfig) -> int:
    """Rounds before the flatness baseline: `warmup_frac` of them, at least `warmup_min`, at most half.

    Arguments:
        config: the `SoakConfig`.

    Returns:
        rounds: int.
    """
    return min(config.rounds // 2, max(int(config.rounds * config.warmup_frac), config.warmup_min))


# ---------------------------------------------------------------------------------------------- inputs
def _token_pool(source: int, config: SoakConfig) -> list:
    """Rank `source`'s `X_POOL` token tensors `[T, H]` torch.bfloat16, integers in [-8, 8]."""
    import torch

    pool = []
    for j in range(X_POOL):
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + source * 1009 + j)
        values = torch.randint(-8, 9, (config.tokens, config.hidden), generator=generator, dtype=torch.int32)
        pool.append(values.to(torch.bfloat16).contiguous())
    return pool


def _token_counts(tokens: int) -> tuple:
    return tuple(sorted({tokens, max(1, tokens * 3 // 4), max(1, tokens // 2), max(1, tokens // 4)}, reverse=True))


def _round_inputs(source: int, index: int, config: SoakConfig, pool: list, counts: tuple):
    """Round `index` of rank `source`: (x `[n, H]` bf16, topk_idx `[n, K]` int64, weights `[n, K]` f32)."""
    import torch

    generator = torch.Generator().manual_seed(((config.seed * 7_919 + source) << 32) + index)
    n = counts[int(torch.randint(0, len(counts), (1,), generator=generator))]
    scores = torch.rand((n, config.experts), generator=generator)
    topk = scores.topk(config.top_k, dim=1).indices.to(torch.int64)
    dropped = torch.rand((n, config.top_k), generator=generator) < 0.05
    topk.masked_fill_(dropped, -1)
    weights = torch.randint(1, 17, (n, config.top_k), generator=generator, dtype=torch.int32).to(torch.float32) / 16
    return pool[index % X_POOL][:n], topk.contiguous(), weights.contiguous()


# ---------------------------------------------------------------------------------------------- reference
def _check_round(rank: int, num_ranks: int, index: int, config: SoakConfig, pools: list, counts: tuple,
                 recv_x, recv_count, combined, active) -> Optional[str]:
    """None when this rank's outputs of round `index` are exactly right, else what differed.

    Independent reference: every source's inputs rebuilt from the seeds; expected rows per local
    expert by source rank ascending, then token; combined = bf16(sum_k w_k * x), exact in float32.
    """
    import torch

    if int(active.sum()) != num_ranks:
        return f"active_ranks: a peer was marked inactive (mask {active.tolist()})"
    local = config.experts // num_ranks
    inputs = [_round_inputs(source, index, config, pools[source], counts) for source in range(num_ranks)]
    for e in range(local):
        expert = rank * local + e
        rows = [x[(topk == expert).any(1)] for x, topk, _ in inputs]
        expected = torch.cat(rows) if rows else torch.empty((0, config.hidden), dtype=torch.bfloat16)
        count = int(recv_count[e])
        if count != expected.size(0):
            return f"recv_count[{e}]: expected {expected.size(0)}, got {count}"
        if not torch.equal(recv_x[e, :count], expected):
            bad = int((recv_x[e, :count] != expected).any(1).nonzero()[0])
            return f"recv_x[{e}]: row {bad} of {count} differs from the reference"
    x, topk, weights = inputs[rank]
    w = torch.where(topk >= 0, weights, torch.zeros_like(weights))
    reference = (w.unsqueeze(-1) * x.float().unsqueeze(1)).sum(1).to(torch.bfloat16)
    if combined.shape != reference.shape or not torch.equal(combined, reference):
        if combined.shape != reference.shape:
            return f"combined: expected shape {tuple(reference.shape)}, got {tuple(combined.shape)}"
        bad = int((combined != reference).any(1).nonzero()[0])
        return f"combined: token {bad} of {reference.size(0)} differs from bf16(sum_k w_k * x)"
    return None


# ---------------------------------------------------------------------------------------------- sampling
def _status_fields() -> dict:
    fields = {}
    with open("/proc/self/status", encoding="ascii", errors="replace") as handle:
        for line in handle:
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:", "Threads:")):
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0])
    return fields


def _malloc_bytes() -> tuple:
    """glibc malloc: (bytes in use, incl. mmapped chunks; bytes free inside the arenas)."""
    return tuple(_native.malloc_bytes())


def _shm_handles() -> int:
    """fds and mappings of this process that refer to memfd or /dev/shm objects."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own fd, or one closed meanwhile
            continue
        if target.startswith(("/memfd:", "/dev/shm/")):
            count += 1
    with open("/proc/self/maps", encoding="ascii", errors="replace") as handle:
        for line in handle:
            if "/memfd:" in line or "/dev/shm/" in line:
                count += 1
    return count


def sample(round_index: int, buffer=None) -> dict:
    """One resource sample of this process.

    Arguments:
        round_index: rounds completed when sampled.
        buffer: the soaked `Buffer` (its output pool's bytes are recorded), or None.

    Returns:
        sample: dict with `round`, `rss_kib` (VmRSS) and its parts `anon_kib` (RssAnon: heap, malloc,
            torch tensors), `file_kib` (RssFile) and `shmem_kib` (RssShmem: touched pages of the
            memfd regions, this rank's and mapped peers'), `malloc_used_kib` / `malloc_free_kib` (glibc
            mallinfo2: bytes allocated by native code and Python, incl. mmapped chunks / free bytes held
            in the malloc arenas; torch's CPU tensors come from malloc too), `fds` (entries of /proc/self/fd), `py_threads`
            (`threading.active_count()`), `threads` (native, /proc/self/status), `store_workers` (of
            them, the store clients' worker threads: made on demand, ended after `IDLE_S` idle), `shm_handles`
            (memfd or /dev/shm fds and mappings), `pool_bytes`, `py_objects` (GC-tracked) and
            `dev_shm` (machine-wide /dev/shm entries), `traced_kib` (tracemalloc's current bytes, -1 when
            not tracing).
    """
    status = _status_fields()
    try:
        dev_shm = len(os.listdir("/dev/shm"))
    except OSError:
        dev_shm = -1
    malloc_used, malloc_free = _malloc_bytes()
    return {"round": round_index, "rss_kib": status.get("VmRSS", -1), "anon_kib": status.get("RssAnon", -1),
            "file_kib": status.get("RssFile", -1), "shmem_kib": status.get("RssShmem", -1),
            "malloc_used_kib": malloc_used // 1024, "malloc_free_kib": malloc_free // 1024, "fds": len(os.listdir("/proc/self/fd")),
            "py_threads": threading.active_count(), "threads": status.get("Threads", -1),
            "store_workers": sum(t.name.startswith(STORE_WORKER_PREFIX) for t in threading.enumerate()),
            "shm_handles": _shm_handles(), "pool_bytes": buffer.output_pool_bytes() if buffer is not None else 0,
            "py_objects": len(gc.get_objects()), "dev_shm": dev_shm,
            "traced_kib": tracemalloc.get_traced_memory()[0] // 1024 if tracemalloc.is_tracing() else -1}


# ---------------------------------------------------------------------------------------------- one rank
def soak_rank(ctx, config: SoakConfig) -> dict:
    """Run the soak on this rank (inside a `LocalCluster`; collective over `ctx.group`).

    Arguments:
        ctx: the `launch.RankContext`.
        config: the `SoakConfig`.

    Returns:
        result: dict with `samples` (list of `sample()` dicts, the first taken before the Buffer
            existed, the second after it was made, then every `sample_every` rounds), `after_destroy`
            (a sample once the Buffer was destroyed), `threads_left` (sorted names of the Python threads
            alive then that were not before the Buffer), `round_seconds` (median, p99, max of a round),
            `loop_seconds` (wall time of the whole loop, checks and samples included),
            `time_first`/`time_last` (median round time in the first and last tenth after the warm-up),
            `checks` (per mode: sync, async_finish, hook), `failures` (list of str, at most 10),
            `failure_count`, `transport` (the path the Buffer used), `cpu_seconds` (this process's CPU
            time over the loop).
    """
    import torch
    import torch.distributed as dist

    from mooncake_ep_switch import Buffer

    rank, num_ranks = ctx.rank, ctx.num_ranks
    pools = [_token_pool(source, config) for source in range(num_ranks)]
    counts = _token_counts(config.tokens)
    times = array.array("d", bytes(8 * config.rounds))
    samples = [sample(0)]
    threads_before = {thread.ident for thread in threading.enumerate()}
    checks = {"sync": 0, "async_finish": 0, "hook": 0}
    failures: List[str] = []
    failure_count = 0
    size = Buffer.get_ep_buffer_size_hint(config.tokens, config.hidden, num_ranks, config.experts)
    active = torch.ones(num_ranks, dtype=torch.int32)
    T, E = config.tokens, config.experts
    with Buffer(ctx.group, size, disable_p2p=config.transport == "mooncake", transport=config.transport) as buffer:
        path = buffer.transport
        if config.trace:
            tracemalloc.start(4)
        warm_round = warmup_rounds(config)
        snapshot = None
        samples.append(sample(0, buffer))
        held = collections.deque(maxlen=1)  # the previous round's results stay alive during this one
        dist.barrier(group=ctx.group)
        cpu0, start = time.process_time(), time.perf_counter()
        for index in range(config.rounds):
            x, topk, weights = _round_inputs(rank, index, config, pools[rank], counts)
            mode = ("sync", "async_finish", "hook")[index % 3]
            began = time.perf_counter()
            if mode == "sync":
                recv_x, recv_count, handle, event, hook = buffer.dispatch(x, topk, active, T, E, TIMEOUT_US,
                                                                          use_fp8=False)
                combined, event, hook = buffer.combine(recv_x, topk, weights, active, TIMEOUT_US, handle)
            elif mode == "async_finish":
                recv_x, recv_count, handle, event, hook = buffer.dispatch(x, topk, active, T, E, TIMEOUT_US,
                                                                          use_fp8=False, async_finish=True)
                event.current_stream_wait()
                combined, event, hook = buffer.combine(recv_x, topk, weights, active, TIMEOUT_US, handle,
                                                    async_finish=True)
                event.current_stream_wait()
            else:
                recv_x, recv_count, handle, event, hook = buffer.dispatch(x, topk, active, T, E, TIMEOUT_US,
                                                                          use_fp8=False, return_recv_hook=True)
                hook()
                combined, event, hook = buffer.combine(recv_x, topk, weights, active, TIMEOUT_US, handle,
                                                   return_recv_hook=True)
                hook()
            times[index] = time.perf_counter() - began
            if (index + 1) % config.check_every == 0 or index == config.rounds - 1:
                problem = _check_round(rank, num_ranks, index, config, pools, counts, recv_x, recv_count, combined,
                                       active)
                checks[mode] += 1
                if problem is not None:
                    failure_count += 1
                    if len(failures) < 10:
                        failures.append(f"round {index} ({mode}): {problem}")
                    active.fill_(1)  # keep going: every rank runs every round, so none waits on a deadline
            held.append((recv_x, recv_count, handle, combined))
            # Only `held` outlives the round (events and hooks hold their call's tensors).
            del recv_x, recv_count, handle, combined, event, hook
            if (index + 1) % config.sample_every == 0 or index == config.rounds - 1:
                samples.append(sample(index + 1, buffer))
                if config.trace and snapshot is None and index + 1 >= warm_round:
                    snapshot = tracemalloc.take_snapshot()
        loop_seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu0
        growth = []
        if config.trace:
            if snapshot is not None:
                stats = tracemalloc.take_snapshot().compare_to(snapshot, "lineno")[:10]
                growth = [f"{stat.size_diff / 1024:+.1f} KiB ({stat.count_diff:+d} blocks) "
                          f"{stat.traceback[0].filename}:{stat.traceback[0].lineno}" for stat in stats]
            tracemalloc.stop()
        held.clear()
        dist.barrier(group=ctx.group)
    gc.collect()
    after_destroy = sample(config.rounds)
    threads_left = sorted(t.name for t in threading.enumerate() if t.ident not in threads_before)
    ordered = sorted(times)
    warm = warmup_rounds(config)
    tenth = max(1, (config.rounds - warm) // 10)
    return {"samples": samples, "after_destroy": after_destroy, "threads_left": threads_left, "transport": path, "num_ranks": num_ranks,
            "round_seconds": {"median": ordered[len(ordered) // 2], "p99": ordered[min(len(ordered) - 1,
                                                                                     int(len(ordered) * 0.99))],
                              "max": ordered[-1]},
            "time_first": sorted(times[warm:warm + tenth])[tenth // 2],
            "time_last": sorted(times[-tenth:])[tenth // 2],
            "loop_seconds": loop_seconds, "cpu_seconds": cpu_seconds, "checks": checks,
            "failures": failures, "failure_count": failure_count, "traced_growth": growth}


# ---------------------------------------------------------------------------------------------- verdict
def verdict(result: dict, config: SoakConfig, rss_tol_mib: float, rss_tol_pct: float, judge_rss: bool = True) -> dict:
    """Flatness and correctness verdict of one rank's `soak_rank` result.

    Arguments:
        result: the dict `soak_rank` returned.
        config: the `SoakConfig` it ran.
        rss_tol_mib: RSS growth allowed after the warm-up, MiB ...
        rss_tol_pct: ... or this percentage of the baseline RSS, whichever is larger.
        judge_rss: False: RSS growth is reported but never a problem (runs too short to reach the
            plateau: shm RSS reaches it after ~1000 rounds, the TE's after ~250).

    Returns:
        verdict: dict with `baseline_round`, `growth` (per sampled figure: last post-warm-up sample
            minus the baseline), `rss_growth_mib` (largest post-warm-up RSS minus the baseline),
            `rss_tol_mib` (the tolerance applied), `rss_slope_kib_per_1k` (least-squares slope),
            `rounds_per_s`, `ms_per_round` (median), `ok` (bool), `problems` (list of str) and `notes`
            (list of str: variations within an allowance, e.g. `TE_POOL_FDS_PER_PEER`).
    """
    # The store clients' workers start at a store call and end after IDLE_S idle (a slow round under load lets
    # them end mid-run): threads are judged without them, and they are judged against their own bound.
    samples = [dict(s, py_threads=s["py_threads"] - s["store_workers"], threads=s["threads"] - s["store_workers"])
               for s in result["samples"][1:]]  # from the Buffer's creation on
    warm = warmup_rounds(config)
    post = [s for s in samples if s["round"] >= warm and s["round"] > 0] or samples[-1:]
    base, last = post[0], post[-1]
    keys = ("rss_kib", "anon_kib", "file_kib", "shmem_kib", "malloc_used_kib", "malloc_free_kib", "fds", "py_threads",
            "threads", "store_workers", "shm_handles", "pool_bytes", "py_objects", "dev_shm", "traced_kib")
    growth = {key: last[key] - base[key] for key in keys}
    rss_growth_kib = max(s["rss_kib"] for s in post) - base["rss_kib"]
    tolerance_kib = max(rss_tol_mib * 1024, base["rss_kib"] * rss_tol_pct / 100)
    slope = 0.0
    if len(post) > 2:
        xs = [s["round"] for s in post]
        ys = [s["rss_kib"] for s in post]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        denominator = sum((a - mx) ** 2 for a in xs)
        slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / denominator * 1000 if denominator else 0.0
    problems = []
    if judge_rss and rss_growth_kib > tolerance_kib:
        problems.append(f"RSS grew {rss_growth_kib / 1024:.2f} MiB after the warm-up "
                        f"(tolerance {tolerance_kib / 1024:.2f} MiB)")
    notes = []
    for key, label in (("fds", "open fds"), ("py_threads", "Python threads"), ("threads", "native threads"),
                       ("shm_handles", "shared-memory handles")):
        values = {s[key] for s in post}
        if len(values) <= 1:
            continue
        slack = te_pool_fds(result) if key == "fds" else 0
        if max(values) - min(values) <= slack:
            notes.append(f"{label} varied within the Transfer Engine's connection pool ({min(values)}..{max(values)}, "
                         f"allowance +{slack})")
            continue
        problems.append(f"{label} not constant after the warm-up: {base[key]} -> {last[key]} "
                        f"(range {min(values)}..{max(values)})")
    workers = max(s["store_workers"] for s in samples)
    if workers > STORE_WORKERS_MAX:
        problems.append(f"{workers} store worker threads at once (at most {STORE_WORKERS_MAX}: a call lane and a "
                        "wait lane)")
    elif len({s["store_workers"] for s in post}) > 1:
        notes.append(f"store worker threads came and went after the warm-up ({min(s['store_workers'] for s in post)}.."
                     f"{max(s['store_workers'] for s in post)}; idle ones end after {IDLE_S:g} s)")
    if result["failure_count"]:
        problems.append(f"{result['failure_count']} check(s) failed: " + "; ".join(result["failures"][:3]))
    return {"baseline_round": base["round"], "growth": growth, "rss_growth_mib": rss_growth_kib / 1024,
            "rss_tol_mib": tolerance_kib / 1024, "rss_judged": judge_rss, "rss_slope_kib_per_1k": slope,
            "rounds_per_s": config.rounds / result["loop_seconds"],
            "ms_per_round": result["round_seconds"]["median"] * 1e3, "ok": not problems, "problems": problems,
            "notes": notes}


# The Transfer Engine's TCP transport pools its data connections per peer and opens another one when
# every pooled one is busy (a write submitted before the previous one's completion handler returned
# its connection; under CPU load that happens later in a run), then keeps it until it idles out. So
# over TE the open fds may step up after the warm-up by a few connections per peer, each seen on both
# ends; a leak goes past that (and keeps growing over a long soak).
TE_POOL_FDS_PER_PEER = 8


def te_pool_fds(result: dict) -> int:
    """How many fds the Transfer Engine's connection pool may add after the warm-up (0 off TE)."""
    if result.get("transport") != "mooncake":
        return 0
    return TE_POOL_FDS_PER_PEER * max(1, int(result.get("num_ranks", 2)) - 1)


def format_rank(transport: str, rank: int, result: dict, config: SoakConfig, judged: dict) -> str:
    """The printed table and verdict of one rank (markdown table, then verdict lines).

    Arguments:
        transport: the requested transport.
        rank: the rank.
        result: `soak_rank`'s result.
        config: the `SoakConfig`.
        judged: `verdict`'s result.

    Returns:
        text: str, no trailing newline.
    """
    lines = [f"### {transport} (path {result['transport']}), rank {rank}: {config.rounds} rounds, "
             f"T={config.tokens} H={config.hidden} E={config.experts} K={config.top_k} bf16, "
             f"modes sync / async_finish / hook 1:1:1",
             "",
             "| round | RSS MiB | anon | file | shmem | malloc used | malloc free | fds | py threads | threads | shm handles | pool MiB | "
             "py objects | /dev/shm |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    labelled = [("before Buffer", result["samples"][0]), ("Buffer made", result["samples"][1])]
    labelled += [(str(s["round"]), s) for s in result["samples"][2:]]
    labelled.append(("destroyed", result["after_destroy"]))
    for label, s in labelled:
        mark = " (baseline)" if s is not result["samples"][0] and s["round"] == judged["baseline_round"] and \
            label not in ("Buffer made", "destroyed") else ""
        lines.append(f"| {label}{mark} | {s['rss_kib'] / 1024:.1f} | {s['anon_kib'] / 1024:.1f} | "
                     f"{s['file_kib'] / 1024:.1f} | {s['shmem_kib'] / 1024:.1f} | {s['malloc_used_kib'] / 1024:.1f} | "
                     f"{s['malloc_free_kib'] / 1024:.1f} | {s['fds']} | {s['py_threads']} | {s['threads']} | "
                     f"{s['shm_handles']} | {s['pool_bytes'] / 2 ** 20:.1f} | {s['py_objects']} | {s['dev_shm']} |")
    g = judged["growth"]
    rs = result["round_seconds"]
    checks = result["checks"]
    lines += ["",
              f"verdict {transport} rank {rank}: {('FLAT' if judged['rss_judged'] else 'OK (fds, threads, checks)') if judged['ok'] else 'FAIL'} after warm-up "
              f"(baseline round {judged['baseline_round']}): RSS {g['rss_kib'] / 1024:+.2f} MiB at the end, "
              f"max {judged['rss_growth_mib']:+.2f} MiB ("
              f"{'tolerance %.2f' % judged['rss_tol_mib'] if judged['rss_judged'] else 'not judged: too few rounds'}; anon "
              f"{g['anon_kib'] / 1024:+.2f}, file {g['file_kib'] / 1024:+.2f}, shmem {g['shmem_kib'] / 1024:+.2f}; malloc used "
              f"{g['malloc_used_kib'] / 1024:+.2f}, free {g['malloc_free_kib'] / 1024:+.2f}), slope "
              f"{judged['rss_slope_kib_per_1k']:+.1f} KiB/1000 rounds; fds {g['fds']:+d}; py threads "
              f"{g['py_threads']:+d}; native threads {g['threads']:+d}; shm handles {g['shm_handles']:+d}; "
              f"py objects {g['py_objects']:+d}",
              f"  checks exact: {sum(checks.values()) - result['failure_count']}/{sum(checks.values())} "
              f"(sync {checks['sync']}, async_finish {checks['async_finish']}, hook {checks['hook']}); "
              f"{judged['rounds_per_s']:.0f} rounds/s over the loop ({result['loop_seconds']:.1f} s, checks and "
              f"samples included, CPU {result['cpu_seconds']:.1f} s); per round median "
              f"{rs['median'] * 1e3:.3f} ms, p99 {rs['p99'] * 1e3:.3f} ms, max {rs['max'] * 1e3:.1f} ms; median "
              f"first/last tenth after warm-up {result['time_first'] * 1e3:.3f}/{result['time_last'] * 1e3:.3f} ms"]
    if result["samples"][-1]["traced_kib"] >= 0:
        lines.append(f"  tracemalloc: Python allocations {g['traced_kib'] / 1024:+.2f} MiB after the warm-up; top growth:")
        lines += [f"    {line}" for line in result["traced_growth"][:5]]
    for note in judged.get("notes", ()):
        lines.append(f"  note: {note}")
    for problem in judged["problems"]:
        lines.append(f"  problem: {problem}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- driver
def run_soak(config: SoakConfig, num_ranks: int = 2, rss_tol_mib: float = 2.0, rss_tol_pct: float = 1.0,
             timeout_s: Optional[float] = None, judge_rss: bool = True) -> dict:
    """Soak one transport on a fresh local cluster and judge every rank.

    Arguments:
        config: the `SoakConfig`.
        num_ranks: ranks of the cluster (`config.experts` must be a multiple).
        rss_tol_mib: RSS growth tolerance after the warm-up, MiB (or rss_tol_pct, whichever is larger).
        rss_tol_pct: RSS growth tolerance, percent of the baseline RSS.
        timeout_s: deadline of the whole run (default: 300 s + 0.25 s per round).
        judge_rss: whether RSS growth can fail the verdict (see `verdict`).

    Returns:
        report: dict with `config` (dict), `ranks` (per rank: `result` and `verdict`), `text` (str,
            the printed tables) and `ok` (bool: every rank flat and exact).

    Raises:
        RuntimeError: a rank failed or missed the deadline (`launch.check_outcomes`).
    """
    from mooncake_ep_switch.launcher.launch import LocalCluster, check_outcomes

    if timeout_s is None:
        timeout_s = 300.0 + 0.25 * config.rounds
    with LocalCluster(num_ranks) as cluster:
        results = check_outcomes(cluster.run(soak_rank, config, timeout_s=timeout_s))
    ranks, texts = [], []
    for rank, result in enumerate(results):
        judged = verdict(result, config, rss_tol_mib, rss_tol_pct, judge_rss)
        ranks.append({"result": result, "verdict": judged})
        texts.append(format_rank(config.transport, rank, result, config, judged))
    return {"config": config._asdict(), "num_ranks": num_ranks, "ranks": ranks, "text": "\n\n".join(texts),
            "ok": all(r["verdict"]["ok"] for r in ranks)}


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def main(argv=None) -> int:
    """Run the soak on shm and the Transfer Engine; print tables and verdicts.

    Arguments:
        argv: command-line arguments (see `--help`), or None for `sys.argv[1:]`.

    Returns:
        status: int, 0 when every transport and rank is flat after the warm-up and every check is
            exact, else 1.
    """
    parser = argparse.ArgumentParser(prog="python -m mooncake_ep_switch.bench soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds-shm", type=int, default=10_000, help="rounds over shm (0: skip; default 10000)")
    parser.add_argument("--rounds-te", type=int, default=1_000,
                        help="rounds over the Transfer Engine (0: skip; default 1000)")
    parser.add_argument("--ranks", type=_positive, default=2, help="ranks (default 2)")
    parser.add_argument("--tokens", type=_positive, default=128, help="T (default 128)")
    parser.add_argument("--hidden", type=_positive, default=2048, help="H, a multiple of 128 (default 2048)")
    parser.add_argument("--experts", type=_positive, default=16, help="E (default 16)")
    parser.add_argument("--topk", type=_positive, default=4, help="K (default 4)")
    parser.add_argument("--check-every", type=_positive, default=50, help="exact check period (default 50)")
    parser.add_argument("--samples", type=_positive, default=20,
                        help="resource samples per transport after the Buffer is made (default 20)")
    parser.add_argument("--warmup-frac", type=float, default=0.1, help="warm-up fraction (default 0.1) ...")
    parser.add_argument("--warmup-min", type=int, default=300,
                        help="... but at least this many rounds, at most half of them (default 300)")
    parser.add_argument("--rss-tol-mib", type=float, default=2.0, help="RSS growth tolerance, MiB (default 2)")
    parser.add_argument("--rss-tol-pct", type=float, default=1.0, help="... or percent of RSS (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", action="store_true",
                        help="tracemalloc from the Buffer's creation on: where Python allocations grow (slower)")
    parser.add_argument("--quick", action="store_true",
                        help="300 rounds over shm and 150 over the TE; RSS growth is printed but not judged (its "
                             "plateau comes after ~1000 shm / ~250 TE rounds); fds, threads and checks are judged as in a full run")
    parser.add_argument("--out", default=None, help="also write every sample and verdict (json) to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds_shm, args.rounds_te = min(args.rounds_shm, 300), min(args.rounds_te, 150)
    if args.rounds_shm < 0 or args.rounds_te < 0:
        parser.error(f"--rounds-shm/--rounds-te: expected >= 0, got {args.rounds_shm}/{args.rounds_te}")
    if args.hidden % 128:
        parser.error(f"--hidden: expected a multiple of 128, got {args.hidden}")
    if args.experts % args.ranks:
        parser.error(f"--experts: expected a multiple of --ranks={args.ranks}, got {args.experts}")
    if args.topk > args.experts:
        parser.error(f"--topk: expected <= --experts={args.experts}, got {args.topk}")
    if not 0 <= args.warmup_frac < 1:
        parser.error(f"--warmup-frac: expected in [0, 1), got {args.warmup_frac}")
    import torch

    torch.set_num_threads(1)
    reports = []
    ok = True
    for transport, rounds in (("shm", args.rounds_shm), ("mooncake", args.rounds_te)):
        if rounds == 0:
            continue
        config = SoakConfig(transport, rounds, args.tokens, args.hidden, args.experts, args.topk, args.check_every,
                            max(1, rounds // args.samples), args.warmup_frac, args.seed, warmup_min=args.warmup_min,
                            trace=args.trace)
        print(f"[soak] {transport}: {rounds} rounds, R={args.ranks}", file=sys.stderr, flush=True)
        report = run_soak(config, args.ranks, args.rss_tol_mib, args.rss_tol_pct, judge_rss=not args.quick)
        print(report["text"] + "\n", flush=True)
        reports.append(report)
        ok = ok and report["ok"]
    summary = ("every transport and rank flat after warm-up, every check exact" if not args.quick else
               "fds, threads and shm handles constant after warm-up, every check exact (--quick: RSS not judged)")
    print(f"soak: {summary if ok else 'FAILED'}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"ok": ok, "reports": [{k: v for k, v in r.items() if k != "text"} for r in reports]}, handle,
                      indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
