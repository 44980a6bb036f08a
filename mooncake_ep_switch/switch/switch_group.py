"""The process group a collective switch runs on, kept to the current view.

A `UnifiedWeights` that is not one-sided (its Buffer's transport is `"mooncake"`: shared memory inside a
host, the Transfer Engine across, which map no weights) switches with gloo collectives. The group it was
built with is the Buffer's constructor group: after a membership change that group still names the
replaced ranks' dead processes, and a replacement's Buffer has none. `switch_group` gives the switch a
gloo group of the current view instead, built through the group's store the first time a switch runs in
that epoch (every rank calls `switch_layout` together, so every member meets in the rendezvous) and kept
for the epoch. On the `"collective"` transport and on Mooncake's `_use_fallback`, the structures' group is
the fallback's own view group (kept current by `buffer.peer_regions`), used as it is.
"""
from typing import List, Optional, Tuple

from mooncake_ep_switch.buffer.membership.group_keys import view_group
from mooncake_ep_switch.buffer.membership.protocol import View

__all__ = ["switch_group"]


def switch_group(buffer, unified, timeout_s: float) -> Tuple[Optional[object], List[int]]:
    """The group a collective switch of `unified` runs on now (and `unified.group` set to it).

    Arguments:
        buffer: the `Buffer` of the group.
        unified: its `UnifiedWeights` (not one-sided).
        timeout_s: the group's timeout for a group built here (finite, > 0).

    Returns:
        group: the process group, or None when the current view lacks ranks.
        missing: ranks of the group that are not members of the current view (a switch needs them all:
            replace them first); empty when `group` is given.

    Raises:
        RuntimeError: a new view but no store to build its group through.
    """
    on_fallback = buffer.transport == "collective" or buffer.process_group is not buffer.group  # Mooncake's fallback
    epoch = buffer.epoch
    if on_fallback or (epoch == 0 and unified.group is not None):
        return unified.group, []
    members = tuple(buffer.members)
    missing = [r for r in range(unified.num_ranks) if r not in members]
    if missing:
        return None, missing
    built = getattr(unified, "view_group", None)
    if built is None or built[0] != epoch:
        membership = getattr(buffer, "membership", None)
        if membership is None:
            raise RuntimeError("switch_layout: the weights' group lost ranks and the Buffer has no store to build "
                               "the current view's group through; pass store= to Buffer")
        group = view_group(membership.store, View(epoch, members), unified.rank, timeout_s, prefix="mep/switch")
        built = unified.view_group = (epoch, group)
    unified.group = built[1]
    return built[1], []
