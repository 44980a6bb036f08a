"""The process group a collective switch or TP all-reduce runs on, kept to the current view.

A structure that is not one-sided (its Buffer's transport is `"mooncake"`: shared memory inside a host,
the Transfer Engine across, which map no weights) runs gloo collectives: a `UnifiedWeights` switches with
them, a `TPAllReduce` gathers its partials with them. The group it was built with is the Buffer's
constructor group: after a membership change that group still names the replaced ranks' dead processes,
and a replacement's Buffer has none. `epoch_group` gives the structure a gloo group of the current view
instead, built through the group's store the first time it runs a collective in that epoch (every rank
calls it together, so every member meets in the rendezvous) and kept for the epoch; each structure
rendezvouses under keys of its own (its participant index), so several switching in one epoch never
meet. On the `"collective"` transport and on Mooncake's `_use_fallback`, the fallback's group of the
current view (`buffer.process_group`) is used.

- `switch_group`: a switch needs every rank (each holds a shard); a view lacking ranks refuses, naming them
  (on the fallback too: after a shrink its group holds the survivors only).
- `all_reduce_group`: an all-reduce runs over the members of the current view (a rank outside it
  contributes nothing, as a dead source on the one-sided path).

Either refuses by name when a member of the view is known dead (`buffer.dead_peers()`: seen by the
peer watcher, not sealed out yet, e.g. while the store has no quorum): a gloo collective with a dead
member raised "Connection closed by peer" on some ranks and waited for the group's timeout on others,
past the caller's deadline. A death that a rank has not seen yet still takes it into gloo, where the
callers wait through `group_wait` (by their own deadline and the peer watcher, not the group's timeout).
"""
from typing import List, Optional, Tuple

from mooncake_ep_switch.buffer.membership.group_keys import view_group
from mooncake_ep_switch.buffer.membership.protocol import View
from mooncake_ep_switch.errors import MembershipError

__all__ = ["switch_group", "all_reduce_group", "epoch_group", "on_fallback", "dead_members", "count_call_without_group"]


def on_fallback(buffer) -> bool:
    """Whether `buffer` runs its calls on the collective fallback (its `process_group` is the fallback's).

    Arguments:
        buffer: a `Buffer`.

    Returns:
        on_fallback: bool (built on the `"collective"` transport, or Mooncake's `_use_fallback` set).
    """
    return buffer.transport == "collective" or buffer.process_group is not buffer.group


def dead_members(buffer) -> List[int]:
    """Members of the current view whose process is known to have ended (not sealed out yet).

    Arguments:
        buffer: a `Buffer`.

    Returns:
        ranks: list of int, ascending ([] on the collective transport, which watches no peer).
    """
    members = set(buffer.members)
    return [r for r in buffer.dead_peers() if r in members]


def epoch_group(buffer, owner, members: Tuple[int, ...], timeout_s: float, prefix: str, caller: str):
    """A gloo group of the current view for `owner`, built through the store once per epoch.

    Collective over `members` the first time in an epoch (kept on `owner.view_group` as `(epoch, group)`);
    after n calls of the epoch that ended without it (`count_call_without_group`: refused, or the rendezvous
    failed), the rendezvous meets under `<prefix>/attempt<n>`.

    Arguments:
        buffer: the `Buffer` of the group (its epoch, rank and membership store are used).
        owner: the structure the group is for; two structures must pass different `prefix`es.
        members: the current view's ranks (group rank = position).
        timeout_s: the group's timeout in seconds (finite, > 0).
        prefix: key prefix of the group's rendezvous (the epoch is appended).
        caller: the name errors start with.

    Returns:
        group: a `torch.distributed.ProcessGroupGloo`.

    Raises:
        RuntimeError: no store to build the group through.
    """
    epoch = buffer.epoch
    built = getattr(owner, "view_group", None)
    if built is None or built[0] != epoch:
        membership = getattr(buffer, "membership", None)
        if membership is None:
            raise RuntimeError(f"{caller}: the group lost ranks and the Buffer has no store to build the current "
                               "view's group through; pass store= to Buffer")
        attempt = _calls_without_group(owner, epoch)
        count_call_without_group(owner, epoch)  # taken back below once the group is built
        group = view_group(membership.store, View(epoch, members), buffer.rank, timeout_s,
                           prefix=f"{prefix}/attempt{attempt}" if attempt else prefix)
        owner.group_attempt = (epoch, attempt)
        built = owner.view_group = (epoch, group)
    return built[1]


# A rendezvous that did not complete (a store without quorum at the caller's deadline, a peer that never came)
# may leave keys that land late (a stalled etcd member resumes, an abandoned store call goes through): a rank
# that read such a stale address at the next attempt went into gloo with a listener long closed and failed at
# the group's timeout. Every rank of the view ends such a call alike (its rendezvous failed, or it refused
# before it: a rank that saw a death refuses while a peer that did not fails in the rendezvous), so each counts
# the calls of the epoch that ended without a group and the next one meets under keys of its own.
def _calls_without_group(owner, epoch: int) -> int:
    found = getattr(owner, "group_attempt", None)
    return found[1] if found is not None and found[0] == epoch else 0


def count_call_without_group(owner, epoch: int) -> None:
    """Count a call of `epoch` on `owner` that ends without its group of the view (refused, or its rendezvous
    failed): `epoch_group`'s next rendezvous of the epoch meets under `<prefix>/attempt<n>`.

    Arguments:
        owner: the structure the group is for (its `view_group` and `group_attempt` are used).
        epoch: the Buffer's current epoch.
    """
    built = getattr(owner, "view_group", None)
    if built is None or built[0] != epoch:
        owner.group_attempt = (epoch, _calls_without_group(owner, epoch) + 1)


def switch_group(buffer, unified, timeout_s: float) -> Tuple[Optional[object], str]:
    """The group a collective switch of `unified` runs on now (and `unified.group` set to it).

    On the fallback: the fallback's group of the current view; otherwise the constructor's group in
    epoch 0, after a membership change a group of the view built for `unified` (`epoch_group`, keys
    `mep/switch/<participant index>/group/<epoch>`; `.../<participant index>/attempt<n>/group/<epoch>` after n
    calls of the epoch that ended without a group: refused, or their rendezvous failed).

    Arguments:
        buffer: the `Buffer` of the group.
        unified: its `UnifiedWeights` (not one-sided; `group`, `index`, `num_ranks` are used).
        timeout_s: the group's timeout for a group built here (finite, > 0).

    Returns:
        group: the process group, or None when the switch cannot run.
        refusal: why not, naming the ranks (members known dead, or ranks missing from the current
            view: a switch needs them all); "" when `group` is given.

    Raises:
        RuntimeError: a new view but no store to build its group through.
    """
    dead = dead_members(buffer)
    if dead:
        count_call_without_group(unified, buffer.epoch)
        return None, (f"ranks {dead} are dead but still members of the current view: a collective switch needs "
                      "every rank (seal them out with update_ep_member() and admit their replacements first)")
    members = tuple(buffer.members)
    missing = [r for r in range(unified.num_ranks) if r not in members]
    if missing:  # on the fallback too: after a shrink its group holds the survivors only
        count_call_without_group(unified, buffer.epoch)
        return None, (f"ranks {missing} are not members of the current view: a collective switch needs every "
                      "rank (admit their replacements first)")
    if on_fallback(buffer):  # the fallback's group of the current view (every rank: group rank = EP rank)
        unified.group = buffer.process_group
    elif buffer.epoch > 0 or unified.group is None:
        suffix = "" if unified.index is None else f"/{unified.index}"  # one rendezvous per structure and epoch
        unified.group = epoch_group(buffer, unified, members, timeout_s, f"mep/switch{suffix}", "switch_layout")
    return unified.group, ""


def all_reduce_group(buffer, owner, timeout_s: float, prefix: str) -> Tuple[object, Tuple[int, ...]]:
    """The group a collective all-reduce of `owner` runs on now, and its members in group-rank order.

    Arguments:
        buffer: the `Buffer` of the group.
        owner: its `TPAllReduce` (not one-sided; `group`, `num_ranks` are used).
        timeout_s: the group's timeout for a group built here (finite, > 0).
        prefix: the owner's own key prefix for a group built here.

    Returns:
        group: the process group.
        members: the EP ranks of `group`, in group-rank order (the current view's members after a
            membership change, every rank in epoch 0). A group of a new view meets under `prefix`, or
            `prefix/attempt<n>` after n calls of the epoch whose rendezvous failed.

    Raises:
        MembershipError: this rank is not a member of the current view (a replacement not admitted
            yet), or members of it are known dead (named; seal them out with update_ep_member()).
        RuntimeError: a new view but no store to build its group through.
    """
    dead = dead_members(buffer)
    if dead:
        count_call_without_group(owner, buffer.epoch)  # a peer that did not see the death fails in the rendezvous
        raise MembershipError(f"all_reduce: ranks {dead} are dead but still members of the current view (epoch "
                              f"{buffer.epoch}); seal them out with update_ep_member() first", missing=dead)
    everyone = tuple(range(owner.num_ranks))
    if on_fallback(buffer):
        group = buffer.process_group
        return group, everyone if group.size() == owner.num_ranks else tuple(buffer.members)
    if buffer.epoch == 0 and owner.group is not None:
        return owner.group, everyone
    members = tuple(buffer.members)
    if buffer.rank not in members:
        raise MembershipError(f"all_reduce: rank {buffer.rank} is not a member of the current view (epoch "
                              f"{buffer.epoch}, members {list(members)}); call update_ep_member() until it is admitted")
    return epoch_group(buffer, owner, members, timeout_s, prefix, "all_reduce"), members
