"""Membership: who is in the group, agreed through the job's store (docs/recovery.md).

    group_keys.py      which group a Buffer belongs to and its store keys (generations, prefixes)
    records.py         the store record codec: validation of every record, HMAC with MEP_JOB_SECRET
    member_records.py  per-rank records on it (states, endpoints, regions, readiness)
    protocol.py        the epoch/view protocol: agree, seal, admit (`Membership`, `View`)
    elastic_view.py    Buffer.update_ep_member() and the collective fallback's recovery, on a BufferCore
    join_ticket.py     elastic.join()'s ticket for a replacement rank
    replacement.py     whether a plain Buffer(group) is a new Buffer or replaces its rank (Mooncake's recovery)

The names callers use are re-exported here (`from mooncake_ep_switch.buffer.membership import
Membership, View, ...`); errors live in `mooncake_ep_switch.errors`.
"""
from mooncake_ep_switch.buffer.membership.protocol import (ACTIVE, INACTIVE, JOINER_BEAT_S, JOINER_PROOF_S, JOINING,
                                                           MEMBER_BEAT_MARK, PENDING_BEAT_S, PENDING_STOP_S, STATES,
                                                           LeftOut, Membership, MembershipError, View, check_seconds)

__all__ = ["ACTIVE", "INACTIVE", "JOINING", "STATES", "JOINER_BEAT_S", "JOINER_PROOF_S", "MEMBER_BEAT_MARK",
           "PENDING_BEAT_S", "PENDING_STOP_S", "LeftOut", "Membership", "MembershipError", "View", "check_seconds"]
