"""The collective combine reads its send rows in place when they already lie in send order
(`collective.packed_prefix`: the ElasticBuffer's inner combine, one local expert holding every row), and
copies them with `coll_combine_pack` otherwise. No processes: the layouts are built by hand."""
import pytest
import torch

from mooncake_ep_switch.buffer.transport.collective import coll_combine_pack, packed_prefix

R, T, H = 4, 8, 128


def layout(blocks, num_local):
    """`[L, R]` torch.int64 layout words from `{(l, s): (begin, count)}` (absent blocks empty)."""
    words = torch.zeros((num_local, R), dtype=torch.int64)
    for (l, s), (begin, count) in blocks.items():
        words[l, s] = (begin << 32) | count
    return words


def packed(x, words):
    """What `coll_combine_pack` sends (the reference)."""
    rows = int((words & 0xFFFFFFFF).sum())
    send = torch.empty((rows, H), dtype=torch.bfloat16)
    assert coll_combine_pack(x, words, T, send) == rows
    return send


def test_rows_in_send_order_are_sent_in_place():
    """Expert 0's blocks one after another from row 0 (sources 0, 2, 3; source 1 sent nothing), the other
    experts empty: the view is `x`'s own memory and holds exactly what the copy would send."""
    x = torch.randn((3, R * T, H)).to(torch.bfloat16)
    words = layout({(0, 0): (0, 3), (0, 2): (3, 5), (0, 3): (8, 2)}, 3)
    send = packed_prefix(x, words, T, 10)
    assert send is not None and send.data_ptr() == x.data_ptr() and send.shape == (10, H)
    assert torch.equal(send, packed(x, words))


@pytest.mark.parametrize("case", ["two experts", "gap", "not from row 0", "sources out of order", "count > T",
                                  "other total", "not contiguous"])
def test_other_layouts_are_copied(case):
    """Any other layout (the legacy Buffer's: several experts per source), a bad one, or a strided `x`:
    None, so that `coll_combine_pack` copies the rows (and names a bad layout)."""
    x = torch.randn((3, R * T, H)).to(torch.bfloat16)
    blocks, rows = {(0, 0): (0, 3), (0, 1): (3, 4)}, 7
    if case == "two experts":
        blocks = {(0, 0): (0, 3), (1, 0): (0, 2), (0, 1): (3, 4)}
        rows = 9
    elif case == "gap":
        blocks = {(0, 0): (0, 3), (0, 1): (4, 4)}
    elif case == "not from row 0":
        blocks = {(0, 0): (1, 3), (0, 1): (4, 4)}
    elif case == "sources out of order":
        blocks = {(0, 0): (4, 3), (0, 1): (0, 4)}
    elif case == "count > T":
        blocks, rows = {(0, 0): (0, T + 1)}, T + 1
    elif case == "other total":
        rows = 8
    words = layout(blocks, 3)
    if case == "not contiguous":
        x = torch.randn((3, R * T, 2 * H)).to(torch.bfloat16)[:, :, :H]
    assert packed_prefix(x, words, T, rows) is None
    if case in ("two experts", "gap", "not from row 0", "sources out of order"):
        # The copy is what these layouts need: it differs from the rows lying at the front of `x`.
        assert not torch.equal(packed(x, words), x.view(-1, H)[:rows])
