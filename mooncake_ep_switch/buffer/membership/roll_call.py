"""A roll call: every rank of a collective step counts itself in, and one key says that all did (issue 40).

No step of the package makes one any more: a Buffer's construction reads its peers' bindings and records in one
background read each that waits until all are there (`batch_reads`, `together`), two store calls where a roll
call and the reads after it made seven. What follows is how construction used it.

A collective exchange through the store (a Buffer's construction: every rank publishes its endpoint or
region record, then reads every peer's) used to have each rank wait for its R-1 peers' keys, and read
which of them were there while some were missing: each such read costs a rank store operations that
grow with the number missing, and at R=256 those reads, queued behind each other, were most of the
construction's time. Here each rank, once its own record is published, adds one to the step's counter
(`roll/<name>/count`); the rank whose add reaches the count sets `roll/<name>/all`, and every rank waits
for that single key (`key_wait.KeyWait`), then reads every record at once. The roll call is only a hint
of when to read: the records read are still checked one by one (validated, authenticated), and a
record missing or invalid then (a rank counted twice, a replacement's new incarnation) is waited for
as before. A rank that never counts itself in (dead) keeps the others waiting until their deadline.
"""
import time

import torch.distributed as dist

from mooncake_ep_switch.buffer.membership.key_wait import KeyWait

__all__ = ["roll_call"]


def roll_call(store, name: str, count: int, deadline: float) -> bool:
    """Count this rank in at the roll call `name` and wait, until `deadline`, until `count` ranks did.

    Arguments:
        store: the store (with the caller's key prefix) every rank of the step uses.
        name: the step's name, unique per collective step (e.g. `"connect/<epoch>"`); counted at
            `roll/<name>/count`, announced at `roll/<name>/all`.
        count: how many ranks take part (each calls this once), >= 1.
        deadline: `time.monotonic()` deadline in seconds.

    Returns:
        all_there: True once `count` ranks counted themselves in; False when `deadline` passed first or the
            counter could not be added to (then the caller waits for the records themselves).

    Raises:
        ValueError: `count` is not an int >= 1.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count: expected an int >= 1 (the ranks taking part), got {count!r}")
    key_all = f"roll/{name}/all"
    try:
        arrived = store.add(f"roll/{name}/count", 1)
        if arrived >= count:  # past it: the step repeated under its name (the records decide, as always)
            store.set(key_all, "1")
    except dist.DistStoreError:
        return False  # not a counter (a foreign writer's value): the caller's own wait decides
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    # One wait on the one key (in the background where the store allows: no store operation while it lasts),
    # looked at until the deadline; never a blocking wait that times out at the deadline (one was seen to return
    # seconds late when many do at once: protocol.Membership.barrier).
    waiter = KeyWait(store, [key_all], left + 1.0)
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        there = waiter.poll(left if waiter.background else min(left, 0.02))
        if there:
            return True
        if time.monotonic() >= deadline:
            return False
        if there is False:  # the wait ended without the key (the store's error): check it per round
            waiter = KeyWait(store, [key_all], left, background=False)
