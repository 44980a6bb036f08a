"""The demo's timeline as a multi-panel PNG: requests, layout, step latency, balancedness, events.

Input (what the demo writes into its metrics)::

    metrics["steps"]:  [{"step": int, "seconds": float,            # required
                         "requests": int, "layout": "ep" | "tp",   # optional
                         "balancedness": float | None}, ...]       # optional
    metrics["events"]: [{"step": int, "kind": str, "label": str}, ...]   # optional
    metrics["recovery"]: {"phases": [{"phase": str, "start_s": float, "seconds": float}, ...],
                          "in_advance": [...]}                       # optional: the wall-clock panel
    metrics["recoveries"]: [recovery, ...]   # optional, instead: one per kill, all in the wall-clock panel
    (steps may also carry "lost_contributions": int | None, drawn as bars in their own panel, and
    "group_size": int, the EP group's size, drawn as a step line in its own panel: the resize demo)

Event kinds with their own colour: ``switch``, ``rebalance``, ``kill``, ``rejoin``, ``shrink``, ``grow`` (others are
grey); labels of events at one step stand side by side. A panel whose key no step carries says
"n/a". With recovery phases, a last panel shows them on the wall clock from the death (seconds),
a warm standby's phases before the death at negative times (with several kills, each kill's phases
from its own death, named "kill N: ..."). Needs matplotlib (the ``plot`` extra); the
Agg backend is used, no display.
"""
import math
import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence

EVENT_COLOURS = {"switch": "tab:purple", "rebalance": "tab:green", "kill": "tab:red", "rejoin": "tab:blue",
                 "shrink": "tab:brown", "grow": "tab:cyan"}
OTHER_EVENT_COLOUR = "tab:gray"
LAYOUT_LEVELS = {"tp": 0, "ep": 1}


def _where(i: Optional[int], key: Optional[str], outer: str = "steps") -> str:
    return f"metrics[{outer!r}]" + ("" if i is None else f"[{i}]") + ("" if key is None else f"[{key!r}]")


def _number(value: Any, where: str, integer: bool = False) -> float:
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{where} must be {'an integer' if integer else 'a number'}, "
                        f"got {type(value).__name__} {value!r}")
    if not integer and not math.isfinite(float(value)):
        raise ValueError(f"{where} must be finite, got {value!r}")
    return int(value) if integer else float(value)


def _entries(metrics: Mapping, key: str, required: bool) -> List[Mapping]:
    if key not in metrics:
        if required:
            raise ValueError(f"metrics is missing the required key {key!r} (a list of dicts)")
        return []
    entries = metrics[key]
    if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, Sequence):
        raise TypeError(f"metrics[{key!r}] must be a list of dicts, got {type(entries).__name__}")
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise TypeError(f"metrics[{key!r}][{i}] must be a dict, got {type(entry).__name__} {entry!r}")
    return list(entries)


def _validated(metrics: Mapping) -> Dict[str, Any]:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict, got {type(metrics).__name__}")
    steps = _entries(metrics, "steps", required=True)
    if not steps:
        raise ValueError("metrics['steps'] must hold at least one step, got an empty list")
    x, seconds, requests, layout, balance, lost, size = [], [], [], [], [], [], []
    for i, s in enumerate(steps):
        for key in ("step", "seconds"):
            if key not in s:
                raise ValueError(f"{_where(i, None)} is missing the required key {key!r}")
        x.append(_number(s["step"], _where(i, "step"), integer=True))
        seconds.append(_number(s["seconds"], _where(i, "seconds")))
        r = s.get("requests")
        requests.append(math.nan if r is None else _number(r, _where(i, "requests"), integer=True))
        lay = s.get("layout")
        if lay is not None and lay not in LAYOUT_LEVELS:
            raise ValueError(f"{_where(i, 'layout')} must be 'ep' or 'tp' (or absent), got {lay!r}")
        layout.append(math.nan if lay is None else LAYOUT_LEVELS[lay])
        b = s.get("balancedness")
        balance.append(math.nan if b is None else _number(b, _where(i, "balancedness")))
        n = s.get("lost_contributions")
        lost.append(math.nan if n is None else _number(n, _where(i, "lost_contributions"), integer=True))
        g = s.get("group_size")
        size.append(math.nan if g is None else _number(g, _where(i, "group_size"), integer=True))
    events = []
    for i, e in enumerate(_entries(metrics, "events", required=False)):
        for key in ("step", "kind"):
            if key not in e:
                raise ValueError(f"{_where(i, None, 'events')} is missing the required key {key!r}")
        kind = e["kind"]
        if not isinstance(kind, str):
            raise TypeError(f"{_where(i, 'kind', 'events')} must be a str, got {type(kind).__name__} {kind!r}")
        label = e.get("label", kind)
        if not isinstance(label, str):
            raise TypeError(f"{_where(i, 'label', 'events')} must be a str, got {type(label).__name__} {label!r}")
        events.append((_number(e["step"], _where(i, "step", "events"), integer=True), kind, label))
    phases = []
    recoveries = [(f"metrics['recoveries'][{i}]", r) for i, r in enumerate(_entries(metrics, "recoveries", False))]
    if not recoveries and isinstance(metrics.get("recovery"), Mapping):
        recoveries = [("metrics['recovery']", metrics["recovery"])]
    coverage = []  # (kill number, seconds from its death to full coverage)
    for number, (name, recovery) in enumerate(recoveries, 1):
        prefix = f"kill {number}: " if len(recoveries) > 1 else ""
        if recovery.get("death_to_full_coverage_s") is not None:
            coverage.append((number, _number(recovery["death_to_full_coverage_s"],
                                             f"{name}['death_to_full_coverage_s']")))
        for key in ("in_advance", "phases"):
            for i, p in enumerate(_entries(recovery, key, required=False)):
                where = f"{name}[{key!r}][{i}]"
                if not isinstance(p.get("phase"), str):
                    raise TypeError(f"{where}['phase'] must be a str, got {p.get('phase')!r}")
                phases.append((prefix + p["phase"], _number(p.get("start_s"), f"{where}['start_s']"),
                               _number(p.get("seconds"), f"{where}['seconds']"), key == "in_advance", number))
    order = sorted(range(len(x)), key=x.__getitem__)
    pick = lambda values: [values[j] for j in order]  # noqa: E731
    return {"step": pick(x), "seconds": pick(seconds), "requests": pick(requests), "layout": pick(layout),
            "balancedness": pick(balance), "lost": pick(lost), "group_size": pick(size), "events": sorted(events), "phases": phases,
            "coverage": coverage}


def plot_demo_timeline(metrics: Mapping, path: str) -> str:
    """Draw the demo's timeline as a PNG: one panel each for requests, layout, latency, balancedness.

    Panels share the step axis: in-flight request count, layout (a step line, TP low, EP high),
    step latency in ms, EPLB balancedness (mean GPU load / max GPU load, 1 = perfectly
    balanced), and, when steps carry them, the top-k contributions lost per step (bars) and the EP
    group's size (a step line). With
    recovery phases a last panel puts them on the wall clock from the death. Every event is a vertical line through all panels, coloured by kind and labelled at
    the top. Steps are drawn in step order whatever their order in the list.

    Arguments:
        metrics: a dict with ``"steps"`` (required: a non-empty list of dicts with ``"step"`` int
            and ``"seconds"`` float; optional ``"requests"`` int, ``"layout"`` ``"ep"``/``"tp"``,
            ``"balancedness"`` float or None, ``"lost_contributions"`` int or None, ``"group_size"`` int),
            ``"events"``
            (optional: a list of dicts with ``"step"`` int, ``"kind"`` str, ``"label"`` str, the label
            defaulting to the kind) and ``"recoveries"`` or ``"recovery"`` (optional, see the module
            docstring).
        path: the PNG to write.

    Returns:
        path: the written path.

    Raises:
        ValueError, TypeError: malformed input; the message names the offending key and entry.
    """
    data = _validated(metrics)
    if not isinstance(path, str) or not path:
        raise TypeError(f"path must be a non-empty str, got {type(path).__name__} {path!r}")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    x = data["step"]
    phases = data["phases"]
    panels = (("requests", "in-flight requests", None), ("layout", "layout", None),
              ("seconds", "step latency (ms)", 1e3), ("balancedness", "balancedness", None))
    ratios = (2, 1, 2, 1.5)
    if not all(math.isnan(v) for v in data["lost"]):  # the demo's lost top-k contributions: a panel of bars
        panels += (("lost", "lost top-k\n(tokens x entries)", None),)
        ratios += (1.2,)
    if not all(math.isnan(v) for v in data["group_size"]):  # the resize demo's EP group size: a step line
        panels += (("group_size", "EP ranks", None),)
        ratios += (1.2,)
    steps_panels = len(panels)
    fig = Figure(figsize=(11, 0.3 * len(phases) + 10.5 if phases else 8.5 + 1.2 * (steps_panels - 4)),
                 constrained_layout=True)
    FigureCanvasAgg(fig)
    ratios += ((0.3 * len(phases) + 0.8,) if phases else ())
    every = fig.subplots(len(ratios), 1, gridspec_kw={"height_ratios": ratios})
    axes = list(every[:steps_panels])
    for ax in axes[1:]:
        ax.sharex(axes[0])
    for ax, (key, ylabel, scale) in zip(axes, panels):
        values = data[key]
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if all(math.isnan(v) for v in values):
            ax.text(0.5, 0.5, f"n/a (no {key!r} in metrics['steps'])", transform=ax.transAxes, ha="center",
                    va="center", color="0.4")
            ax.set_yticks([])
            continue
        if key == "layout":
            ax.step(x, values, where="post", color="tab:purple", lw=1.5)
            ax.set_yticks([0, 1], ["TP", "EP"])
            ax.set_ylim(-0.3, 1.3)
        elif key == "balancedness":
            ax.plot(x, values, marker="o", ms=3, lw=1.0, color="tab:green")
            ax.set_ylim(0.0, 1.05)
        elif key == "group_size":
            ax.step(x, values, where="mid", color="tab:brown", lw=1.5)
            low, high = min(values), max(values)
            ax.set_yticks(range(int(low), int(high) + 1))
            ax.set_ylim(low - 0.5, high + 0.5)
        elif key == "lost":
            ax.bar(x, [0 if math.isnan(v) else v for v in values], width=0.8, color="tab:red", alpha=0.7)
            for step, value in zip(x, values):
                if not math.isnan(value) and value > 0:
                    ax.annotate(f"{value:.0f}", xy=(step, value), xytext=(0, 2), textcoords="offset points",
                                ha="center", fontsize=6)
        else:
            ax.plot(x, [v * scale for v in values] if scale else values, marker="o", ms=2.5, lw=1.0,
                    color="tab:orange" if key == "seconds" else "tab:blue")
    axes[-1].set_xlabel("step")
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    seen, at_step = {}, {}
    for step, kind, label in data["events"]:
        colour = EVENT_COLOURS.get(kind, OTHER_EVENT_COLOUR)
        for ax in axes:
            line = ax.axvline(step, color=colour, ls="--", lw=1.0, alpha=0.8)
        seen.setdefault(kind, line)
        side = at_step[step] = at_step.get(step, -1) + 1  # labels of one step side by side, never on each other
        axes[0].annotate(label, xy=(step, 1.0), xycoords=("data", "axes fraction"), xytext=(2 + 9 * side, -2),
                         textcoords="offset points", rotation=90, va="top", ha="left", fontsize=7, color=colour)
    if seen:
        axes[0].legend(list(seen.values()), list(seen.keys()), loc="upper left", fontsize=8,
                       bbox_to_anchor=(1.0, 1.0), title="events", title_fontsize=8)
    axes[0].set_title("demo timeline")
    if phases:
        _phase_panel(every[-1], phases, data["coverage"])
    fig.savefig(path, dpi=110)
    return path


KILL_COLOURS = ("tab:blue", "tab:purple", "tab:cyan", "tab:olive")


def _phase_panel(ax, phases, coverage=()) -> None:
    """The recoveries' phases as bars on the wall clock from each death (s); each outage (death -> first full
    step) shaded; a standby's phases before the death in grey; a coverage epoch's commit a green line."""
    names = []
    for row, (name, start, seconds, early, number) in enumerate(reversed(phases)):
        colour = "0.6" if early else ("tab:red" if name.endswith("detection") else
                                      KILL_COLOURS[(number - 1) % len(KILL_COLOURS)])
        ax.broken_barh([(start, max(seconds, 1e-3))], (row - 0.4, 0.8), color=colour, alpha=0.8)
        ax.annotate(f"{seconds * 1e3:.0f} ms", xy=(start + seconds, row), xytext=(3, 0), textcoords="offset points",
                    va="center", fontsize=7)
        names.append(name + (" (before)" if early else ""))
    ax.set_yticks(range(len(names)), names, fontsize=7)
    kills = sorted({p[4] for p in phases})
    for number in kills:
        ends = [start + seconds for _, start, seconds, early, n in phases if not early and n == number]
        if ends:
            ax.axvspan(0.0, max(ends), color=KILL_COLOURS[(number - 1) % len(KILL_COLOURS)], alpha=0.07,
                       label="outage: death -> first full step" + (f" (kill {number})" if len(kills) > 1 else ""))
    ax.axvline(0.0, color="tab:red", ls="--", lw=1.0)
    for number, seconds in coverage:
        ax.axvline(seconds, color="tab:green", ls=":", lw=1.5,
                   label="every expert covered again" + (f" (kill {number})" if len(kills) > 1 else ""))
    ax.set_xlabel("wall clock from the death (s)")
    ax.set_title("recovery phases", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper right", fontsize=7)
