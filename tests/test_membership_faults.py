"""Membership under hostile conditions: several EP groups in one job, lone or dead joiners, ranks
left out that come back, bad deadlines, forged or malformed store records.

Multi-rank cases run real processes through tests/harness.py (SIGKILL, SIGSTOP); single-store
cases drive `Membership` objects from threads against one TCPStore. Every wait has a deadline.
"""
import json
import math
import os
import signal
import threading
import time
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mooncake_ep_switch import Buffer
from mooncake_ep_switch.buffer.membership import Membership, MembershipError
from mooncake_ep_switch.elastic import join
from mooncake_ep_switch.launch import free_port
from tests import harness
from tests.reference import structured_inputs, token_count
from tests.test_faults import Shape, _check_round, _mock_expert

_STATE = {}


# ---------------------------------------------------------------------- two EP groups in one job
def _group_round(buffer, local, size, seed):
    """One exact dispatch + combine inside a group of `size` (group-local rank `local`)."""
    all_inputs = [structured_inputs(r, token_count(r, size, Shape.tokens), Shape.hidden, Shape.experts,
                                    Shape.top_k, seed=seed, random_values=True) for r in range(size)]
    mine = all_inputs[local]
    active = torch.ones(size, dtype=torch.int32)
    ctx = types.SimpleNamespace(rank=local, num_ranks=size)
    recv, count, handle, _, _ = buffer.dispatch(mine.x, mine.topk_idx, active, Shape.tokens, Shape.experts,
                                                harness.FAULT_TIMEOUT_US, use_fp8=False)
    combined, _, _ = buffer.combine(_mock_expert(ctx, recv), mine.topk_idx, mine.weights, active,
                                    harness.FAULT_TIMEOUT_US, handle)
    _check_round(ctx, all_inputs, [1] * size, [1] * size, recv, count, handle, combined)


def rank_two_groups(ctx, store_mode, transport):
    """Ranks {0,1} and {2,3} each build a Buffer on their own group; rounds must stay inside it."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    index = ctx.rank // 2
    store = None
    if store_mode == "own_prefix":
        store = dist.PrefixStore(f"attn{index}", ctx.store)
    elif store_mode == "shared_prefix":
        store = dist.PrefixStore("engine", ctx.store)
    size = Buffer.get_ep_buffer_size_hint(Shape.tokens, Shape.hidden, 2, Shape.experts)
    buffer = Buffer(groups[index], size, transport=transport, store=store)
    try:
        for round_index in range(2):
            _group_round(buffer, ctx.rank % 2, 2, seed=900 + 10 * index + round_index)
        return buffer.transport
    finally:
        buffer.destroy()
        dist.barrier(group=ctx.group)
        for group in groups:
            dist.destroy_process_group(group)


@pytest.mark.parametrize("store_mode", ["default", "own_prefix", "shared_prefix"])
@pytest.mark.parametrize("transport", ["shm", "collective"])
def test_two_ep_groups_in_one_job_stay_apart(store_mode, transport):
    transports = harness.run(4, rank_two_groups, store_mode, transport)
    assert transports == [transport] * 4
