"""The PyTorch-collective transport: exact-count all_to_all_single, no all-gather of tokens.

Dispatch is one small count exchange plus one byte exchange in which every (token, destination
rank) pair travels once, whatever number of that rank's experts the token selected; combine is one
exchange of the expert outputs back to their token owners, whose sizes both sides already know from
the dispatch. Works on any process group with all_to_all_single (gloo on CPU, nccl on GPU) and
honours `active_ranks`: nothing is sent to, or expected from, an inactive rank.

The packing kernels (FP8 quantisation, scatter into the packed layout, the weighted combine
reduction) are the native ones shared with the one-sided transports.
"""
from typing import Callable, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from mooncake_ep_switch.buffer import kernels
from mooncake_ep_switch.buffer.calls import CombineCall, DispatchCall, DispatchOutputs


class CollectivePlan(NamedTuple):
    """What a dispatch sent, kept on the handle so that combine needs no count exchange.

    Fields:
        rows_from_rank: `[R]` list of int, expert-output rows this rank will receive from each
            owner rank in combine (the (token, expert) pairs it sent there).
        row_index: `[N, K]` torch.int64, row of the combine receive buffer holding
            `y(topk_idx[t, k], t)`, -1 where nothing was sent.
    """

    rows_from_rank: list
    row_index: torch.Tensor


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


class CollectiveTransport:
    """Dispatch/combine over `torch.distributed.all_to_all_single`.

    Arguments:
        group: the process group (any backend with all_to_all_single).
        rank: this process's rank in `group`.
        num_ranks: the group size.
    """

    name = "collective"

    def __init__(self, group, rank: int, num_ranks: int):
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self._combine_buffers = {}

    def connect(self) -> None:
        """Nothing to exchange: collectives need no peer metadata."""

    def destroy(self) -> None:
        """Drop cached buffers."""
        self._combine_buffers.clear()

    # ------------------------------------------------------------------ helpers
    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits, input_splits, async_op=False):
        return dist.all_to_all_single(output, input, output_split_sizes=output_splits,
                                      input_split_sizes=input_splits, group=self.group, async_op=async_op)

    def combine_buffer(self, call: int, shape, device) -> torch.Tensor:
        """Persistent zero-copy combine buffer for the half of `call` and this shape."""
        key = (call % 2, tuple(shape), str(device))
        buffer = self._combine_buffers.get(key)
        if buffer is None:
            buffer = torch.empty(shape, dtype=torch.bfloat16, device=device)
            self._combine_buffers[key] = buffer
        return buffer

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, call: DispatchCall, outputs: DispatchOutputs) -> Tuple[CollectivePlan, Callable[[], None]]:
        """Run the send phase; return (the plan for combine, the receive phase that fills `outputs`)."""
        x, topk = call.x, call.topk_idx
        R, E, T = self.num_ranks, call.num_experts, call.num_max_dispatch_tokens_per_rank
        L = E // R
        N, K = topk.shape
        hidden = x.size(1)
        groups = hidden // 128
        device = x.device
        active = call.active_ranks.to(device=device, dtype=torch.bool)

        # (token, expert) pairs this rank sends, sorted by expert then token: the receiver's order.
        valid = topk >= 0
        owner = torch.where(valid, topk // L, torch.zeros_like(topk))
        sent = valid & active[owner]
        flat_sent = sent.view(-1).nonzero().view(-1)
        pair_expert = topk.view(-1)[flat_sent]
        pair_token = flat_sent // K
        order = torch.argsort(pair_expert * max(N, 1) + pair_token)
        pair_expert, pair_token, flat_sent = pair_expert[order], pair_token[order], flat_sent[order]
        pair_rank = pair_expert // L
        num_pairs = pair_expert.numel()

        # Unique (token, rank) rows: each token crosses to a rank once.
        token_to_rank = torch.zeros((R, N), dtype=torch.bool, device=device)
        token_to_rank[pair_rank, pair_token] = True
        unique_rank, unique_token = token_to_rank.nonzero(as_tuple=True)
        row_in_block = torch.cumsum(token_to_rank.to(torch.int64), 1) - 1  # [R, N]
        pair_row = row_in_block[pair_rank, pair_token]

        tokens_to = torch.bincount(unique_rank, minlength=R)
        pairs_to = torch.bincount(pair_rank, minlength=R)
        counts_send = torch.stack([tokens_to, pairs_to], 1).to(torch.int64).contiguous()
        counts_recv = torch.empty_like(counts_send)
        self._all_to_all(counts_recv, counts_send, None, None)

        # Payload row: bf16 (2*hidden bytes) or FP8 (hidden bytes + 4 bytes per 128 channels).
        row_bytes = hidden + 4 * groups if call.use_fp8 else 2 * hidden
        unique_token = unique_token.contiguous()
        if call.use_fp8:
            data = torch.empty((unique_token.numel(), hidden), dtype=torch.uint8, device=device)
            scales = torch.empty((unique_token.numel(), groups), dtype=torch.float32, device=device)
            if unique_token.numel():
                kernels.quantize_fp8_rows(x, unique_token, data, scales)
            payload = torch.cat([data, scales.view(torch.uint8)], 1)
        else:
            payload = x.index_select(0, unique_token).view(torch.uint8)

        # Per destination block: payload rows, token ids (int32), pair expert (int32), pair row (int32).
        meta_tokens = unique_token.to(torch.int32)
        meta_pairs = torch.stack([(pair_expert % L).to(torch.int32), pair_row.to(torch.int32)], 1)
        tok_begin = _exclusive_cumsum(tokens_to).tolist()
        pair_begin = _exclusive_cumsum(pairs_to).tolist()
        tokens_to_list, pairs_to_list = tokens_to.tolist(), pairs_to.tolist()
        pieces, input_splits = [], []
        for dest in range(R):
            nt, np_ = tokens_to_list[dest], pairs_to_list[dest]
            tb, pb = tok_begin[dest], pair_begin[dest]
            block = [payload[tb:tb + nt].reshape(-1), meta_tokens[tb:tb + nt].view(torch.uint8),
                     meta_pairs[pb:pb + np_].reshape(-1).view(torch.uint8)]
            pieces.extend(block)
            input_splits.append(nt * (row_bytes + 4) + np_ * 8)
        send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)

        # Accept exactly what every peer announced (a peer whose view of the mask differs must not
        # break the exchange), then drop what inactive sources sent.
        counts_recv_list = counts_recv.tolist()
        output_splits = [nt * (row_bytes + 4) + np_ * 8 for nt, np_ in counts_recv_list]
        recv = torch.empty(sum(output_splits), dtype=torch.uint8, device=device)
        work = self._all_to_all(recv, send, output_splits, input_splits, async_op=True)

        # What combine will receive back: the pairs sent, in the same (owner, expert, token) order.
        row_index = torch.full((N * K,), -1, dtype=torch.int64, device=device)
        row_index[flat_sent] = torch.arange(num_pairs, dtype=torch.int64, device=device)
        plan = CollectivePlan(rows_from_rank=pairs_to_list, row_index=row_index.view(N, K))

        def receive() -> None:
            work.wait()
            accepted = [bool(active[src]) for src in range(R)]
            self._unpack_dispatch(recv, counts_recv_list, accepted, row_bytes, call, outputs, L, T, hidden)

        return plan, receive

    def _unpack_dispatch(self, recv, counts, accepted, row_bytes, call, outputs, L, T, hidden):
        R = self.num_ranks
        device = recv.device
        payload_parts, token_parts, pair_parts, pair_src = [], [], [], []
        offset, token_base = 0, 0
        for src, (nt, np_) in enumerate(counts):
            payload_parts.append(recv[offset:offset + nt * row_bytes].view(nt, row_bytes))
            offset += nt * row_bytes
            token_parts.append(recv[offset:offset + nt * 4].view(torch.int32))
            offset += nt * 4
            pairs = recv[offset:offset + np_ * 8].view(torch.int32).view(np_, 2).to(torch.int64)
            offset += np_ * 8
            if not accepted[src]:
                pairs = pairs[:0]
                np_ = 0
            if np_:
                if int(pairs[:, 0].min()) < 0 or int(pairs[:, 0].max()) >= L or \
                        int(pairs[:, 1].min()) < 0 or int(pairs[:, 1].max()) >= nt:
                    raise RuntimeError(f"collective dispatch: rank {src} sent out-of-range pair metadata")
                pairs[:, 1] += token_base
            pair_parts.append(pairs)
            pair_src.append(torch.full((np_,), src, dtype=torch.int64, device=device))
            token_base += nt
        payload = torch.cat(payload_parts) if payload_parts else recv.new_empty((0, row_bytes))
        tokens = torch.cat(token_parts).to(torch.int64) if token_parts else recv.new_empty(0, dtype=torch.int64)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= T):
            raise RuntimeError("collective dispatch: a peer sent a token index outside [0, T)")
        pairs = torch.cat(pair_parts)
        sources = torch.cat(pair_src)
        local_expert, global_row = pairs[:, 0], pairs[:, 1]

        # Order (local expert, source rank, token): blocks arrive by source and are sorted by
        # (expert, token) inside, so a stable sort on the expert is enough.
        order = torch.sort(local_expert, stable=True).indices
        local_expert, global_row, sources = local_expert[order], global_row[order], sources[order]
        per_expert_source = torch.bincount(local_expert * R + sources, minlength=L * R).view(L, R)
        recv_count = per_expert_source.sum(1)
        expert_begin = _exclusive_cumsum(recv_count)
        position = torch.arange(local_expert.numel(), device=device) - expert_begin[local_expert]
        flat_position = local_expert * (R * T) + position

        outputs.recv_count.copy_(recv_count.to(torch.int32))
        begin = torch.cumsum(per_expert_source, 1) - per_expert_source
        outputs.layout_range.copy_((begin << 32) | per_expert_source)
        outputs.src_info.view(-1)[flat_position] = tokens[global_row].to(torch.int32)
        if call.use_fp8:
            rows = payload.index_select(0, global_row)
            data = rows[:, :hidden].contiguous()
            scales = rows[:, hidden:].contiguous().view(torch.float32)
            kernels.scatter_fp8_rows(data, scales, flat_position.contiguous(), outputs.recv_x, outputs.recv_scales)
        else:
            rows = payload.view(torch.bfloat16).view(-1, hidden)
            outputs.recv_x.view(-1, hidden).index_copy_(0, flat_position, rows.index_select(0, global_row))

    # ------------------------------------------------------------------ combine
    def combine(self, call: CombineCall) -> Callable[[], None]:
        """Run the send phase of combine; return the receive phase, which fills `call.out`."""
        R = self.num_ranks
        L = call.num_experts // R
        T = call.num_max_dispatch_tokens_per_rank
        hidden = call.hidden
        device = call.x.device
        active_now = call.active_ranks.to(device=device, dtype=torch.bool)
        plan: Optional[CollectivePlan] = call.plan_private
        if plan is None:
            raise ValueError("handle: the collective transport needs the handle returned by dispatch() "
                             "(a rebuilt tuple carries no record of what was sent)")

        # Send back exactly what each source sent us (layout_range), in (expert, token) order.
        counts = (call.layout_range & 0xFFFFFFFF)  # [L, R]
        begins = call.layout_range >> 32
        input_splits = counts.sum(0).tolist()
        # Row ids in x.view(-1, hidden): for source s, experts l ascending, rows begin..begin+count.
        order_src = torch.arange(R, device=device).repeat_interleave(L)
        order_exp = torch.arange(L, device=device).repeat(R)
        block_counts = counts[order_exp, order_src]
        block_starts = order_exp * (R * T) + begins[order_exp, order_src]
        total = int(block_counts.sum())
        if total:
            offsets = torch.arange(total, device=device) - torch.repeat_interleave(
                _exclusive_cumsum(block_counts), block_counts)
            rows = torch.repeat_interleave(block_starts, block_counts) + offsets
            send = call.x.view(-1, hidden).index_select(0, rows)
        else:
            send = call.x.new_empty((0, hidden))
        # Confirm sizes with a small count exchange: a rank that dropped our dispatch (its view of
        # the mask differed) returns nothing, and its pairs are then skipped, never misread.
        sizes_send = torch.tensor(input_splits, dtype=torch.int64, device=device)
        sizes_recv = torch.empty_like(sizes_send)
        self._all_to_all(sizes_recv, sizes_send, None, None)
        output_splits = sizes_recv.tolist()
        skipped_owners = []
        for owner_rank, (got, sent) in enumerate(zip(output_splits, plan.rows_from_rank)):
            if got != sent:
                if got != 0:
                    raise RuntimeError(f"collective combine: rank {owner_rank} returned {got} rows for "
                                       f"{sent} sent (mismatched handle or dispatch)")
                skipped_owners.append(owner_rank)
        recv = torch.empty((sum(output_splits), hidden), dtype=torch.bfloat16, device=device)
        work = self._all_to_all(recv, send, output_splits, input_splits, async_op=True)

        def receive() -> None:
            work.wait()
            keep = active_now.clone()
            keep[skipped_owners] = False
            valid = call.topk_idx >= 0
            owner = torch.where(valid, call.topk_idx // L, torch.zeros_like(call.topk_idx))
            row_index = torch.where(keep[owner], plan.row_index, torch.full_like(plan.row_index, -1)).contiguous()
            kernels.combine_reduce(call.out, row_index, call.topk_weights, recv)

        return receive
