"""What a replacement rank passes to `Buffer(...)` in place of a process group (`elastic.join` makes it).

It lives in the buffer package because the Buffer's constructor recognizes it; `mooncake_ep_switch.elastic`
re-exports it with the functions that make one, so `elastic` depends on `buffer` and never the reverse.
"""
from typing import Any, NamedTuple, Optional


class JoinTicket(NamedTuple):
    """What a replacement rank passes to `Buffer(...)` in place of a process group.

    Fields:
        store: client of the group's store.
        rank: the EP rank id this process takes over.
        num_ranks: EP group size.
        prefix: membership key prefix of the EP group.
        group_ranks: global ranks of the EP group in group-rank order, or None for
            `range(num_ranks)` (the members' group was the whole world).
        keep_prefix: `store` is the store the members passed as `store=` (prefixes kept), not a
            client of the default group's store (prefixes removed).
        buffer_index: which of the group's Buffers this joins, counted from 1 in the order every
            member built its Buffers of the group (its generation); None: this process's first
            joined Buffer of the group takes the first, its second the second, and so on.
    """

    store: Any
    rank: int
    num_ranks: int
    prefix: str = "mep"
    group_ranks: Optional[tuple] = None
    keep_prefix: bool = False
    buffer_index: Optional[int] = None
