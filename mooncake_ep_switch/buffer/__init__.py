"""The data plane: `Buffer`, its packed layouts, transports (Python side) and membership.

Glossary (the words the modules here use, one meaning each):

    rank          a process of the EP group, 0..num_ranks-1; "this rank" is the caller's
    epoch         the number of an agreed membership view; it only grows
    view          the member ranks of one epoch (`membership.View`), sealed once in the store
    member        a rank of the current view; a joiner (a replacement, or a rank left out) is not one
                  until update_ep_member() admits it
    incarnation   one process's tenure of a rank; a replacement (or a left-out rank rejoining) takes
                  a new one, and records of older incarnations are refused
    call          one dispatch or combine; the call counter numbers them the same way on every rank
    tag           the call number written into a signal word, so a signal of an older call never
                  completes a newer one
    half          one of the two halves of the EP region; call n uses half n % 2, so a call's rows
                  are never overwritten by the next call's
    signal word   a 64-bit word a sender writes after its data (tag, count); the receiver waits on
                  it with a deadline
    active_ranks  the caller's int32 mask: 0 = neither sent to nor waited for; a source that misses
                  its deadline is set to 0 by the call
    route         how a peer is reached: self, shm (shared memory), te (Transfer Engine), cuda
                  (CUDA IPC) or collective (`Buffer.peer_routes()`)
    core          `core.BufferCore`: a Buffer's view state and collaborators, what its helper
                  modules use of it
"""
from mooncake_ep_switch.buffer.buffer import Buffer
from mooncake_ep_switch.buffer.handle import DispatchHandle, DispatchPlan, EventOverlap
from mooncake_ep_switch.buffer.layout import RegionLayout, region_layout

__all__ = ["Buffer", "DispatchHandle", "DispatchPlan", "EventOverlap", "RegionLayout", "region_layout"]
