"""The API reference's organisation, for scripts/gen_api.py: sections, their intro prose, the entries.

Every entry's text comes from its docstring; what is written here is only what no docstring says
(a section's introduction, a table, a class's instance attributes). A public name of a module in
`FULL_COVERAGE` that no entry lists makes `gen_api.coverage_problems()` (and tests/test_docs.py) fail:
add it to the section it belongs to.
"""
from gen_api import Data, Entry, Section, own_doc
from mooncake_ep_switch import errors

# Modules whose every public name (`__all__`, or the functions and classes they define) is listed.
FULL_COVERAGE = (
    "mooncake_ep_switch",
    "mooncake_ep_switch.errors",
    "mooncake_ep_switch.elastic_buffer",
    "mooncake_ep_switch.elastic",
    "mooncake_ep_switch.standby",
    "mooncake_ep_switch.launcher.launch",
    "mooncake_ep_switch.switch",
    "mooncake_ep_switch.reference.moe_block",
    "mooncake_ep_switch.eplb",
    "mooncake_ep_switch.eplb.online",
    "mooncake_ep_switch.apps.timeline",
    "mooncake_ep_switch.deep_ep",
    "mooncake_ep_switch.metrics",
)

TOP = "mooncake_ep_switch"
SWITCH = "mooncake_ep_switch.switch"
EPLB = "mooncake_ep_switch.eplb"
LAUNCH = "mooncake_ep_switch.launcher.launch"
ELASTIC = "mooncake_ep_switch.elastic"
STANDBY = "mooncake_ep_switch.standby"
MOE = "mooncake_ep_switch.reference.moe_block"
SIMULATOR = "mooncake_ep_switch.switch.planning.simulator"
TRACES = "mooncake_ep_switch.switch.planning.traces"
SIMULATE_CLI = "mooncake_ep_switch.apps.simulate_cli"
DEEP_EP = "mooncake_ep_switch.deep_ep"
METRICS = "mooncake_ep_switch.metrics"
EVENTS = "mooncake_ep_switch.buffer.events"
GROW = "mooncake_ep_switch.buffer.membership.grow"

PREAMBLE = """\
Every public call of `mooncake_ep_switch`, generated from the docstrings of the code (so the text
below is what `help()` shows) by `python scripts/gen_api.py`; tests/test_docs.py fails when this
file differs from its output or when a public name has no entry. Style as in DeepEP: one summary
line, then `Arguments:` / `Returns:` / `Raises:`; tensors are written `[shape]` with their dtype.
Names exported by a package's `__init__` are importable from it
(`from mooncake_ep_switch.switch import switch_layout`); other entries give their module. A class's
entry lists its public methods and properties after it.
"""

BUFFER_ATTRIBUTES = """\
Attributes set at construction (read-only): `rank`, `num_ranks` (int; `group_size` is Mooncake's
name for it), `group` (the process group, None for a replacement rank built from a `JoinTicket` or
admitted as Mooncake's plain-Buffer replacement), `num_ep_buffer_bytes`, `transport` (`"cuda"`,
`"shm"`, `"mooncake"` or `"collective"`: the path in use), `device` (the CUDA device of a `"cuda"`
Buffer's tensors, None for CPU tensors). Failures: `active_mask()` (who is active now),
`dead_peers()` (whose process ended), `members` and `epoch` (the current view), `pending_joiners()`
(replacements waiting to be admitted). `Buffer` is also a context manager (`destroy()` on exit).
"""

ERRORS_INTRO = """\
Everything the runtime raises of its own derives from `MooncakeEpError`; each class also keeps the
builtin base it had before, so `except RuntimeError` / `except ConnectionError` go on working. Bad
arguments stay `ValueError` / `TypeError` (the peers' callers catch those).
"""


def error_table() -> str:
    """The classes of `errors.__all__`: each one's other bases and its docstring's first sentence."""
    rows = ["", "| class | also a | what it says |", "|---|---|---|"]
    for name in errors.__all__:
        cls = getattr(errors, name)
        bases = [base.__name__ for base in cls.__bases__ if base is not errors.MooncakeEpError] or ["Exception"]
        summary = " ".join((own_doc(cls) or "").split("\n\n")[0].split()).split(". ")[0].rstrip(".")
        rows.append(f"| `{name}` | {', '.join(f'`{b}`' for b in bases)} | {summary} |")
    return "\n".join(rows) + "\n"


SECTIONS = (
    Section("Top level (`mooncake_ep_switch`)", items=(
        Entry(TOP, "Buffer", note=BUFFER_ATTRIBUTES, extra=("_use_fallback",), order=(
            "connect", "get_ep_buffer_size_hint", "dispatch", "get_next_combine_buffer", "combine",
            "active_mask", "dead_peers", "members", "epoch", "joining", "pending_joiners", "update_ep_member",
            "switch_layout", "destroy")),
        Section("Errors (`mooncake_ep_switch.errors`, re-exported at the top level)", level=3,
                intro=ERRORS_INTRO + error_table(), items=tuple(Entry(TOP, name) for name in errors.__all__)),
        Entry(TOP, "DispatchHandle"),
        Entry(TOP, "EventOverlap"),
        Entry("mooncake_ep_switch.buffer.handle", "StreamEvent"),
        Data(TOP, "__version__", "The package version (a string, also `mooncake-ep --version`)."),
    )),
    Section("DeepEP V2's ElasticBuffer (`mooncake_ep_switch.ElasticBuffer`)", intro="""\
Layouts, fault rules and what differs from DeepEP V2 and Mooncake: [elastic_buffer.md](elastic_buffer.md).
""", items=(
        Entry(TOP, "ElasticBuffer", order=("dispatch", "combine", "get_buffer_size_hint", "barrier",
                                           "update_ep_member", "active_mask", "pending_joiners", "members",
                                           "destroy")),
        Entry(TOP, "EPHandle"),
    )),
    Section("Elastic membership (`mooncake_ep_switch.elastic`)", intro="""\
How a replacement rank joins a running group and how the members admit it: [recovery.md](recovery.md).
""", items=(
        Entry(ELASTIC, "join", prefix="elastic."),
        Entry(ELASTIC, "connect_store", prefix="elastic."),
        Entry(ELASTIC, "admit", prefix="elastic."),
        Entry(ELASTIC, "JoinTicket", prefix="elastic."),
        Entry(ELASTIC, "grow", prefix="elastic."),
        Entry(ELASTIC, "join_grow", prefix="elastic."),
        Entry(GROW, "GrowOperation", order=("poll", "ready")),
        Entry(GROW, "GrowResult"),
        Data(GROW, "MAX_EP_RANKS", "The largest EP group a grow builds (64); a larger `num_ranks` is refused by name."),
        Section("Warm standby (`mooncake_ep_switch.standby`)", level=3, intro="""\
A replacement made ready before any death (imports, weights, store), told later which rank it replaces:
[recovery.md](recovery.md), "A warm standby".
""", items=(
            Entry(STANDBY, "WarmStandby", prefix="standby."),
            Entry(STANDBY, "rank_process_alive", prefix="standby."),
        )),
    )),
    Section("Local launcher (`mooncake_ep_switch.launcher.launch`)", intro="""\
Local rank processes for tests, benchmarks and the demo (`from mooncake_ep_switch.launcher import launch`).
""", items=(
        Entry(LAUNCH, "LocalCluster", prefix="launch.", order=("run", "respawn", "kill", "close")),
        Entry(LAUNCH, "ClusterNetwork", prefix="launch."),
        Entry(LAUNCH, "RankPlace", prefix="launch."),
        Entry(LAUNCH, "RankContext", prefix="launch."),
        Entry(LAUNCH, "RankOutcome", prefix="launch."),
        Entry(LAUNCH, "check_outcomes", prefix="launch."),
        Entry(LAUNCH, "host_store", prefix="launch."),
        Entry(LAUNCH, "process_created_at", prefix="launch."),
        Data(LAUNCH, "STANDBY", "The rank a standby's functions see (`RankContext.rank`) until `assign_standby` gives it one."),
    )),
    Section("TP <-> EP switching (`mooncake_ep_switch.switch`)", intro="""\
How a switch runs, what it moves and the policy: [switching.md](switching.md). `SwitchError` and
`SwitchFenced` (also exported here) are under [Errors](#errors-mooncake_ep_switcherrors-re-exported-at-the-top-level).
""", items=(
        Section("Switching a running group", level=3, items=(
            Entry(SWITCH, "switch_layout"),
            Entry(SWITCH, "SwitchReport"),
        )),
        Section("Unified weight memory", level=3, items=(
            Entry(SWITCH, "UnifiedWeights"),
            Entry(SWITCH, "WeightShape"),
            Entry(SWITCH, "MemoryReport"),
        )),
        Section("Paged KV cache", level=3, items=(
            Entry(SWITCH, "PagedKVCache"),
            Entry(SWITCH, "KVCacheConfig"),
        )),
        Section("TP all-reduce", level=3, items=(
            Entry(SWITCH, "TPAllReduce"),
        )),
        Section("Policy", level=3, items=(
            Entry(SWITCH, "SwitchPolicy"),
            Entry(SWITCH, "PolicySettings"),
            Entry(SWITCH, "Decision"),
            Entry(SWITCH, "calibrate"),
            Entry(SWITCH, "Calibration"),
        )),
        Section("Simulator and traces", level=3, items=(
            Entry(SWITCH, "CostModel"),
            Entry(SWITCH, "simulate"),
            Entry(SWITCH, "compare"),
            Entry(SIMULATOR, "ComparisonRow", prefix="simulator."),
            Entry(SWITCH, "Metrics"),
            Entry(SIMULATOR, "PhaseMetrics", prefix="simulator."),
            Entry(SWITCH, "format_table"),
            Entry(SWITCH, "plot_timeline"),
            Entry(SWITCH, "bursty_trace"),
            Entry(SWITCH, "rollout_trace"),
            Entry(TRACES, "Trace", prefix="traces."),
            Entry(TRACES, "PhaseSpec", prefix="traces."),
        )),
        Section("Reference MoE block (`mooncake_ep_switch.reference.moe_block`)", level=3, intro="""\
Used by the demo and the tests; weights in the unified layout (gate/up `[E, 2I, H]`, down `[E, H, I]`).
""", items=tuple(Entry(MOE, name, prefix="moe_block.") for name in (
            "MoEWeights", "random_weights", "route", "expert_forward", "reference_forward", "ep_forward",
            "ep_forward_local", "ep_round", "shard_ep", "shard_tp", "tp_partial", "tp_forward"))),
    )),
    Section("Expert-parallel load balancing (`mooncake_ep_switch.eplb`)", intro="""\
Placement, load recording and dispatch maps ([mooncake_ep_switch/eplb/README.md](../mooncake_ep_switch/eplb/README.md));
serving on physical experts and the online rebalance: the next section.
""", items=(
        Section("Placement", level=3, items=(
            Entry(EPLB, "rebalance_experts"),
            Entry(EPLB, "place_experts"),
            Entry(EPLB, "greedy_rebalance_experts"),
            Entry(EPLB, "placement_from_phy2log"),
            Entry(EPLB, "Placement"),
            Entry(EPLB, "place_redundant_experts"),
            Entry(EPLB, "EplbArgumentError"),
            Entry(EPLB, "DefaultEplbPolicy"),
            Entry(EPLB, "compute_logical_maps"),
        )),
        Section("Load recording", level=3, items=(
            Entry(EPLB, "ExpertLoadRecorder"),
            Entry(EPLB, "LoadBalance"),
            Entry(EPLB, "counts_from_topk"),
        )),
        Section("Dispatch maps", level=3, items=(
            Entry(EPLB, "build_dispatch_map"),
            Entry(EPLB, "logical_to_physical"),
            Entry(EPLB, "spread_to_physical"),
            Entry(EPLB, "live_copies"),
            Entry(EPLB, "LiveCopies"),
        )),
        Section("Metrics and redundancy budget", level=3, items=(
            Entry(EPLB, "balancedness"),
            Entry(EPLB, "layer_balancedness"),
            Entry(EPLB, "gpu_loads"),
            Entry(EPLB, "moved_copies"),
            Entry(EPLB, "suggest_redundancy"),
            Entry(EPLB, "RedundancyAdvice"),
        )),
    )),
    Section("Online rebalance (`mooncake_ep_switch.eplb.online`)", intro="""\
Serving on physical experts and moving them while serving (names importable from
`mooncake_ep_switch.eplb`); the protocol is in [eplb.md](eplb.md).
""", items=(
        Entry(EPLB, "ExpertSlots"),
        Entry(EPLB, "SlotShape"),
        Entry(EPLB, "OnlineRebalancer"),
        Entry(EPLB, "RebalanceChunk"),
        Entry(EPLB, "RebalanceReport"),
        Entry(EPLB, "physical_ep_forward"),
        Entry(EPLB, "physical_ep_round"),
        Entry(EPLB, "restore_coverage"),
        Entry(EPLB, "coverage_placement"),
        Entry(EPLB, "uncovered_experts"),
        Entry(EPLB, "shrink_experts"),
        Entry(EPLB, "shrink_placement"),
        Entry(EPLB, "begin_drain"),
        Entry(EPLB, "finish_drain"),
        Entry(EPLB, "grow_placement"),
        Entry(EPLB, "renumber_placement"),
        Entry(EPLB, "grow_slots"),
        Entry(EPLB, "GrownSlots"),
    )),
    Section("Events (`mooncake_ep_switch.buffer.events`)", intro="""\
What `Buffer.subscribe()` delivers, for the engine's policy; what to do on each is in
[recovery.md](recovery.md) ("Events") and [eplb.md](eplb.md) ("Coverage restored online").
""", items=(
        Entry(EVENTS, "Subscription", prefix="events."),
        Entry(EVENTS, "PeerMasked", prefix="events."),
        Entry(EVENTS, "ExpertsUncovered", prefix="events."),
        Entry(EVENTS, "CoverageRestored", prefix="events."),
        Entry(EVENTS, "JoinerPending", prefix="events."),
        Entry(EVENTS, "JoinerAdmitted", prefix="events."),
        Entry(EVENTS, "RankLeftOut", prefix="events."),
    )),
    Section("Metrics export (`mooncake_ep_switch.metrics`)", intro="""\
`Buffer.stats()` as samples, and an optional Prometheus collector (needs `prometheus_client`); the loggers
and the fields are in [observability.md](observability.md).
""", items=(
        Entry(METRICS, "register_prometheus", prefix="metrics."),
        Entry(METRICS, "PrometheusCollector", prefix="metrics."),
        Entry(METRICS, "stats_samples", prefix="metrics."),
        Entry(METRICS, "Sample", prefix="metrics."),
    )),
    Section("Command line and plots", intro="""\
`mooncake-ep` (also `python -m mooncake_ep_switch`) has three subcommands:

| command | what it does |
| --- | --- |
| `demo [--ranks N] [--steps N] [--transport T] [--device D] [--model NAME] [--out DIR] [--kill-step N]` | the main job: serves a small MoE model on local CPU ranks, kills two ranks in turn (one whose experts all have live copies elsewhere, then one holding the only copy of some experts: coverage restored online) and replaces each, checks every step against a reference (`--help` for defaults) |
| `bench [...]` | transport, switch and EPLB benchmarks with in-run baselines ([benchmarks.md](benchmarks.md)) |
| `bench soak [...]` | soak benchmark (`python -m mooncake_ep_switch bench soak`): by default 10^4 shm and 10^3 Transfer Engine dispatch + combine rounds at R=2, results checked exactly, RSS, fds and threads sampled; exit code 1 if a check fails or resources are not flat after the warm-up ([benchmarks.md](benchmarks.md)) |
| `simulate [--seed 0] [--quick] [--calibrate] [--out DIR] [--no-plot]` | replays a bursty serving trace and an RL-rollout trace through the switch policy; exit code 1 if the paper's qualitative result does not hold ([simulate.md](simulate.md)) |
""", items=(
        Entry(SIMULATE_CLI, "run_simulation", prefix="simulate_cli."),
        Entry(SIMULATE_CLI, "cpu_calibration", prefix="simulate_cli."),
        Entry(SIMULATE_CLI, "check_bursty", prefix="simulate_cli."),
        Entry(SIMULATE_CLI, "check_rollout", prefix="simulate_cli."),
        Entry(SIMULATE_CLI, "policy_settings", prefix="simulate_cli."),
        Entry("mooncake_ep_switch.apps.timeline", "plot_demo_timeline", prefix="timeline."),
    )),
    Section("DeepEP V1 low-latency compatibility (`mooncake_ep_switch.deep_ep`)", intro="""\
`import mooncake_ep_switch.deep_ep as deep_ep` replaces `import deep_ep` for engines written against
DeepEP V1's low-latency API (`deep_ep/buffer.py` before DeepEP's V2 rewrite, which moved it to
`deep_ep/buffers/legacy.py`): the module exports `Buffer`, `EventOverlap` (ours, the same methods:
`current_stream_wait()`, `with event:`, `extra_tensors`) and `topk_idx_t` (`torch.int64`, DeepEP's).
`deep_ep.Buffer` is a thin layer over `mooncake_ep_switch.Buffer` (reachable as `buffer.buffer`): it
checks DeepEP's arguments (errors name the argument, the expectation and what came, before anything
changes), keeps a deadline (`timeout_us`, a constructor keyword of ours, default 10 s, settable as
`buffer.timeout_us`) and in shrink mode a Buffer-owned `active_ranks` that is DeepEP's mask buffer,
and our Buffer moves the bytes on any transport (`transport=` keyword, default `"auto"`).
Tests: tests/test_deep_ep_compat.py (DeepEP V1's low-latency test loop on shm, the Transfer Engine
and the collective fallback; shrink mode; bad arguments).

```python
import mooncake_ep_switch.deep_ep as deep_ep          # instead of: import deep_ep

hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(T, hidden, group.size(), E)
buffer = deep_ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, num_qps_per_rank=E // group.size(),
                        explicitly_destroy=True, enable_shrink=True)
buffer.clean_low_latency_buffer(T, hidden, E)
stats = torch.zeros(E // group.size(), dtype=torch.int)
(recv_x, recv_scales), recv_count, handle, event, hook = buffer.low_latency_dispatch(
    x, topk_idx.to(deep_ep.topk_idx_t), T, E, cumulative_local_expert_recv_stats=stats,
    use_fp8=True, round_scale=True, use_ue8m0=True, return_recv_hook=True)
hook()
# ... experts write into buffer.get_next_low_latency_combine_buffer(handle) ...
combined_x, event, hook = buffer.low_latency_combine(y, topk_idx, topk_weights, handle, zero_copy=True)
```

What follows DeepEP's semantics:

* shapes, dtypes and layouts: `recv_x` `[E_local, R*T, hidden]` (FP8: e4m3fn data and scales with the
  token axis contiguous, float32 `[E_local, R*T, hidden/128]`, with `use_ue8m0` int32
  `[E_local, R*T, hidden/512]`, four UE8M0 exponent bytes per int32, channel group `4p+j` in byte `j`,
  little-endian); `recv_count` `[E_local]` int32; the handle is the 5-tuple `(src_info, layout_range,
  T, hidden, num_experts)` with `layout_range = (begin << 32) | count`;
* `round_scale`: scales `2^ceil(log2(max(amax, 1e-4) * float32(1/448)))` per 128 channels and the rows
  cast with them (saturating), bit for bit DeepEP's kernel arithmetic; `use_ue8m0` requires
  `round_scale` (ValueError, as DeepEP's assertion);
* `cumulative_local_expert_recv_stats` (`[E_local]` int32): each dispatch adds the tokens every
  local expert received, when its receive phase completes (the call, the hook, or the event);
* completion: `async_finish` and `return_recv_hook` exclusive; `hook()` receives; a zero-copy combine
  takes its rows from `get_next_low_latency_combine_buffer(handle)` and ignores `x`; `out=` is written
  and returned; `use_logfmt` with `zero_copy` is refused;
* shrink mode (`enable_shrink=True`): a rank that misses the deadline in dispatch, combine or
  `clean_low_latency_buffer` is masked; masked ranks are neither sent to nor waited for, their rows
  are absent and combine skips their experts (no renormalisation);
  `low_latency_update_mask_buffer(rank, mask)` masks (True) or unmasks (False) a rank,
  `low_latency_query_mask_buffer(t)` writes 1 = masked, 0 = unmasked into an int32 `[num_ranks]`
  tensor, `low_latency_clean_mask_buffer()` unmasks all; without shrink mode the three raise
  RuntimeError (DeepEP: a failed assertion);
* `destroy()` only with `explicitly_destroy=True` (RuntimeError otherwise).

Deliberate differences:

* only the low-latency mode: `low_latency_mode=False` raises NotImplementedError in the constructor,
  and the normal-mode calls that exist (`dispatch`, `combine`, `get_dispatch_layout`,
  `internode_dispatch`, `internode_combine`) raise NotImplementedError; `Config`,
  `get_dispatch_config`/`get_combine_config`, `get_comm_stream`, `get_local_buffer_tensor` and an
  mpi4py `comm` are not offered;
* a missed deadline without shrink mode raises RuntimeError naming the ranks (DeepEP's kernel traps);
  the deadline is ours (`timeout_us`, per call and source; never infinite), DeepEP's is a fixed
  ~10-100 s of GPU cycles;
* `use_logfmt` is accepted and ignored: combine sends bf16 rows and is exact (DeepEP's LogFMT is a
  lossy 10-bit format);
* `round_scale` dispatches move bf16 rows and the receiver casts them (exactly DeepEP's values, twice
  the FP8 bytes on the wire); plain FP8 is ours (scale `amax / 448`, DeepEP multiplies by
  `float32(1/448)`: a scale, and rarely an FP8 value, can differ in the last bit);
* `dispatch_wait_recv_cost_stats` / `combine_wait_recv_cost_stats` are checked (`[num_ranks]` int64)
  and not written (no per-source wait cycles are measured);
* `clean_low_latency_buffer` is a barrier (a dispatch of no tokens) and zeroes nothing (signals are
  sequence-tagged); FP8 needs `hidden % 128 == 0` (DeepEP 512; UE8M0 512 here too), no `R*T % 4`
  condition; `num_nvl_bytes`, `num_qps_per_rank`, `allow_mnnvl`, `use_fabric` are checked and unused;
  `allow_nvlink_for_low_latency_mode=False` is our `disable_p2p=True`;
* events are host-side `EventOverlap`s: `current_stream_wait()` completes the call and is safe on
  every event (DeepEP's is valid only with `async_finish`); an `async_finish` dispatch whose event was
  not waited is completed by the next call of the Buffer.
""", items=(
        Entry(DEEP_EP, "Buffer", prefix="deep_ep.", members_as="deep_ep.Buffer", order=(
            "get_low_latency_rdma_size_hint", "clean_low_latency_buffer", "low_latency_dispatch",
            "low_latency_combine", "get_next_low_latency_combine_buffer", "low_latency_update_mask_buffer",
            "low_latency_query_mask_buffer", "low_latency_clean_mask_buffer", "destroy", "capture",
            "set_num_sms")),
        Data(DEEP_EP, "topk_idx_t", "The dtype of `topk_idx`: `torch.int64` (DeepEP's `deep_ep.topk_idx_t`).",
             prefix="deep_ep."),
        Data(DEEP_EP, "DEFAULT_TIMEOUT_US",
             "`deep_ep.Buffer`'s default deadline per call and source, in microseconds: 10 s (DeepEP's "
             "kernels give up after a fixed ~10-100 s of GPU cycles).", prefix="deep_ep."),
    )),
)
