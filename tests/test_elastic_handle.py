"""`EPHandle`'s attributes are plain attributes to a caller, as in DeepEP V2 (issue 42): V2's own test
program (tests/elastic/test_ep.py, `--do-cpu-sync 0`) trims a handle in place with
`handle.recv_src_metadata = handle.recv_src_metadata[:num_recv_tokens]` after reading it. The three that
this runtime computes when first read (recv_src_metadata, dst_buffer_slot_idx,
psum_num_recv_tokens_per_scaleup_rank) take an assignment, before or after that first read, and read
back what was assigned. Pure torch, no ranks."""
from types import SimpleNamespace

import torch

from mooncake_ep_switch.elastic_buffer.handle import EPHandle

T, R, K, E = 4, 2, 2, 4
LAZY = ("recv_src_metadata", "dst_buffer_slot_idx", "psum_num_recv_tokens_per_scaleup_rank")


def _handle():
    """A handle of 3 received tokens whose three lazy attributes are computed from a small route."""
    topk_idx = torch.tensor([[0, 2], [1, -1], [3, 2]])
    route = SimpleNamespace(recv_src_global=torch.tensor([0, 2, 5]),
                            recv_local_topk=torch.tensor([[0, -1], [1, -1], [-1, 0]]), slots=None)
    return EPHandle(do_expand=False, num_experts=E, expert_alignment=1, num_max_tokens_per_rank=T, num_sms=0,
                    topk_idx=topk_idx, num_recv_tokens=3, num_expanded_tokens=0,
                    num_recv_tokens_per_expert_list=[2, 1], psum_num_recv_tokens_per_scaleup_rank=None,
                    psum_num_recv_tokens_per_expert=torch.tensor([2, 3], dtype=torch.int32),
                    num_unaligned_recv_tokens_per_expert=None, recv_src_metadata=None, dst_buffer_slot_idx=None,
                    route=route, num_ranks=R)


def test_v2_trims_recv_src_metadata_in_place_after_reading_it():
    handle = _handle()
    meta = handle.recv_src_metadata
    assert meta[:, 0].tolist() == [0, 2, 5] and meta[:, 1].tolist() == [0, 0, 3]  # src_rank * K + first entry
    handle.recv_src_metadata = handle.recv_src_metadata[:2]  # V2's program, --do-cpu-sync 0
    assert torch.equal(handle.recv_src_metadata, meta[:2])


def test_each_lazy_attribute_takes_an_assignment_before_or_after_its_first_read():
    for read_first in (False, True):
        handle = _handle()
        for name in LAZY:
            if read_first:
                getattr(handle, name)
            value = torch.arange(6, dtype=torch.int32)
            setattr(handle, name, value)
            assert getattr(handle, name) is value, name
    assert _handle().psum_num_recv_tokens_per_scaleup_rank.tolist() == [2, 3]  # computed when never assigned
    assert _handle().dst_buffer_slot_idx.tolist() == [[0, 0], [1, -1], [-1, 1]]
