"""The demo's recovery, phase by phase: wall clocks (`time.time()`) taken in every process, put on one line.

A death is followed by its detection (the survivors served the step without the dead rank), the
survivors serving on (the rest of that step with its check, and the steps they serve before the
replacement starts, `DemoConfig.replace_after`), then the replacement's phases: process start, imports (interpreter, torch, the package, the store
connection), Buffer construction, join (the members list it as pending), admission (the members'
`update_ep_member()` returned), restore (its expert weights from the peers' copies) and the first full
step. A warm standby did the process start, the imports and the weights before the death; they are
reported as `in_advance`, and its phases after the death start with being assigned the rank.
"""
from typing import Dict, List, Optional

__all__ = ["recovery_phases", "phase_lines"]


def _span(name: str, start: Optional[float], end: Optional[float], origin: float) -> Optional[dict]:
    if start is None or end is None:
        return None
    return {"phase": name, "start_s": start - origin, "seconds": max(0.0, end - start)}


def recovery_phases(killed_at: float, detected_at: float, stepped_at: float, started: Dict[str, float], replacement: Dict[str, float],
                    members: List[Dict[str, float]], first_full_at: float, kind: str) -> dict:
    """The recovery's phases, each from the wall clocks of the process that saw it.

    Arguments:
        killed_at: when the rank killed itself.
        detected_at: when the last survivor had served the step without it.
        stepped_at: when the controller had every survivor's result of the last step served without the rank
            (checked against the reference): the replacement starts then.
        started: the replacement process's start (`LocalCluster.respawn` / `start_standby`): "spawn",
            "created", "ready" (and for a standby "prepared", "assigned").
        replacement: its own times: "setup_started", "buffer_built", "admitted", "restored".
        members: each member's "pending_seen" (the joiner listed) and "admitted" (its `update_ep_member()`
            returned, after the replacement's regions were mapped).
        first_full_at: when every rank had returned the first step served by all.
        kind: "standby" (a warm standby), "forked" (a process forked after the death from a preloaded
            server) or "spawn" (a fresh interpreter started after the death).

    Returns:
        recovery: dict with "kind" ("warm standby" / "cold"), "detection_s", "interruption_s"
            (death -> first full step), "replacement_s" (spawn or assignment -> first full step),
            "phases" (list of {"phase", "start_s" (from the death), "seconds"}, in order),
            "in_advance" (a standby's phases before the death, else []) and "other_s" (the time
            between phases: the controller's messages).
    """
    pending = min(m["pending_seen"] for m in members) if members else None
    admitted = replacement["admitted"]  # the members return later: they wait for its regions (restore)
    resumed = max([m["admitted"] for m in members] + [replacement["restored"]])
    launch = [_span("process start", started["spawn"], started["created"], killed_at),
              _span("imports", started["created"], started["ready"], killed_at)]
    after = [_span("detection", killed_at, detected_at, killed_at),
             _span("survivors serve", detected_at, stepped_at, killed_at)]
    standby = kind == "standby"
    if standby:
        after.append(_span("assign", stepped_at, started["assigned"], killed_at))
        in_advance = [p for p in launch + [
            _span("prepare (weights)", started["ready"], started["prepared"], killed_at)] if p is not None]
        begin = started["assigned"]
    else:
        after += launch
        in_advance = []
        begin = started["spawn"]
    after += [_span("buffer", replacement["setup_started"], replacement["buffer_built"], killed_at),
              _span("join", replacement["buffer_built"], pending, killed_at),
              _span("admission", pending, admitted, killed_at),
              _span("restore", replacement["admitted"], replacement["restored"], killed_at),
              _span("members resume", replacement["restored"], resumed, killed_at),
              _span("first full step", resumed, first_full_at, killed_at)]
    phases = [p for p in after if p is not None]
    measured = sum(p["seconds"] for p in phases)
    return {"kind": {"standby": "warm standby", "forked": "cold (forked, imports preloaded)",
                     "spawn": "cold (fresh interpreter)"}[kind], "detection_s": detected_at - killed_at,
            "interruption_s": first_full_at - killed_at, "replacement_s": first_full_at - begin,
            "phases": phases, "in_advance": in_advance,
            "other_s": max(0.0, (first_full_at - killed_at) - measured)}


def phase_lines(recovery: dict) -> List[str]:
    """The printout's lines for `recovery_phases`' result."""
    lines = [f"  recovery phases      {recovery['kind']}: death -> first full step {recovery['interruption_s']:.2f} s "
             f"(detection {recovery['detection_s']:.2f} s + {recovery['interruption_s'] - recovery['detection_s']:.2f} s)"]
    lines.append("    " + ", ".join(f"{p['phase']} {p['seconds'] * 1e3:.0f} ms" for p in recovery["phases"])
                 + f", between phases {recovery['other_s'] * 1e3:.0f} ms")
    if recovery["in_advance"]:
        lines.append("    in advance (before the death): " + ", ".join(
            f"{p['phase']} {p['seconds'] * 1e3:.0f} ms" for p in recovery["in_advance"]))
    return lines
