"""`elastic_buffer.inner_rows`: where an inner dispatch put a slot's rows, as a slice when they allow one
(issue 42 item 4: the received rows are read and written in place, no index gathered), and the same rows
and sources as the index form in every layout. Pure torch, no ranks."""
import torch

from mooncake_ep_switch.elastic_buffer.inner_rows import as_index, inner_sources

T = 10


def _handle(blocks, slot=0, num_ranks=3):
    """A fake inner handle: `blocks[source] = (begin, tokens)` for `slot`."""
    src_info = torch.full((3, num_ranks * T), -1, dtype=torch.int32)
    layout_range = torch.zeros((3, num_ranks), dtype=torch.int64)
    for source, (begin, tokens) in blocks.items():
        src_info[slot, begin:begin + len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        layout_range[slot, source] = (begin << 32) | len(tokens)
    return src_info, layout_range


def _reference(blocks):
    """Rows and `src_rank * T + token`, sorted by the latter, from the blocks directly."""
    pairs = sorted((source * T + token, begin + i) for source, (begin, tokens) in blocks.items()
                   for i, token in enumerate(tokens))
    return [row for _, row in pairs], [key for key, _ in pairs]


def _check(blocks, expect_slice):
    handle = _handle(blocks)
    rows, src_global = inner_sources(handle, 0, T, as_slice=True)
    want_rows, want_src = _reference(blocks)
    assert isinstance(rows, slice) == expect_slice, rows
    assert as_index(rows, "cpu").tolist() == want_rows
    assert src_global.tolist() == want_src
    index_rows, index_src = inner_sources(handle, 0, T)
    assert isinstance(index_rows, torch.Tensor) and index_rows.tolist() == want_rows
    assert index_src.tolist() == want_src


def test_contiguous_ascending_blocks_are_one_slice():
    _check({0: (0, [1, 4]), 1: (2, [0, 2, 3]), 2: (5, [7])}, expect_slice=True)
    _check({1: (0, [5])}, expect_slice=True)


def test_a_gap_between_blocks_is_an_index():
    _check({0: (0, [1, 4]), 2: (3, [7])}, expect_slice=False)


def test_blocks_out_of_source_order_are_sorted():
    _check({0: (3, [1, 4]), 1: (0, [0, 2, 3])}, expect_slice=False)


def test_tokens_not_ascending_inside_a_block_are_sorted():
    _check({0: (0, [4, 1]), 1: (2, [3])}, expect_slice=False)


def test_no_rows():
    rows, src_global = inner_sources(_handle({}), 0, T, as_slice=True)
    assert rows == slice(0, 0) and src_global.numel() == 0
