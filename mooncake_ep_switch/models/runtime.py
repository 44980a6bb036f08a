"""A transformers MoE model's expert layers executed over the runtime (EP, TP, redundant experts).

`ModelRuntime.attach(model)` replaces the `experts` module of every MoE block with a
`ServedExperts`: the same call (`experts(hidden_states, top_k_index, top_k_weights)`), so the
model's own router, shared experts, attention and everything else run unchanged. The expert weights
leave the model: this rank keeps only what it owns in the runtime's `ExpertMemory`.

Each rank runs its own sequences through attention (data-parallel attention). Per MoE layer:

- EP layout: the router's top-k ids (logical experts) are mapped to physical experts by this
  rank's dispatch map when there are redundant experts, the tokens go through `Buffer.dispatch`,
  every local physical expert runs the model's expert MLP (its activation, gate/up then down, in
  the model's dtype) on its received rows, and `Buffer.combine` sums the weighted outputs (float32,
  no renormalisation: an expert on a dead rank contributes nothing);
- TP layout: the rows, top-k ids and weights of every rank are gathered bit-exactly through the TP
  all-reduce (zeros elsewhere, float32 sum), every rank runs its intermediate slice of every
  selected expert on all rows (float32 down projection), and the all-reduce sums the partials; the
  rank keeps its own rows.

Per-slot token counts of the EP steps are recorded (`take_counts`) for the EPLB controller.
"""
from typing import List, Optional

import torch
import torch.nn.functional as F

from mooncake_ep_switch.switch.unified_weights import EP


class ServedExperts(torch.nn.Module):
    """Drop-in replacement of a transformers fused-experts module that runs over a `ModelRuntime`.

    Arguments:
        runtime: the rank's `ModelRuntime`.
        layer: index of this MoE layer among the model's MoE blocks.
        act_fn: the model's expert activation (e.g. SiLU), applied to the gate projection.
    """

    def __init__(self, runtime: "ModelRuntime", layer: int, act_fn):
        super().__init__()
        self.runtime = runtime
        self.layer = layer
        self.act_fn = act_fn

    def mlp(self, rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """The model's expert MLP on `rows` `[n, H]` with one expert's `gate_up` `[2I, H]` and `down` `[H, I]`.

        Arguments:
            rows: `[n, H]` torch.bfloat16 tokens routed to the expert.
            gate_up: `[2I, H]` torch.bfloat16, gate rows then up rows.
            down: `[H, I]` torch.bfloat16.

        Returns:
            out: `[n, H]` torch.bfloat16, `down(act(gate(x)) * up(x))` computed as the model does.
        """
        gate, up = F.linear(rows, gate_up).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, down)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Routed experts of this layer for this rank's tokens.

        Arguments:
            hidden_states: `[N, H]` torch.bfloat16, this rank's tokens.
            top_k_index: `[N, K]` integer logical expert ids from the model's router.
            top_k_weights: `[N, K]` floating routing weights from the model's router.

        Returns:
            out: `[N, H]` torch.bfloat16, `sum_k w_k * expert_k(x)` over the experts of live ranks.
        """
        return self.runtime.run(self, hidden_states, top_k_index, top_k_weights)


class ModelRuntime:
    """One rank's execution of a model's MoE layers over a Buffer and an `ExpertMemory`.

    Arguments:
        buffer: the `Buffer` of the EP group (sized for `tokens_per_rank` tokens and the physical
            experts).
        memory: this rank's `ExpertMemory` (its layout is the layout served).
        tokens_per_rank: `num_max_dispatch_tokens_per_rank`, the most tokens a rank serves per call.
        active_ranks: `[R]` torch.int32 mask, caller-owned; ranks that miss a deadline are set to 0.
        timeout_us: deadline of every dispatch, combine and all-reduce.
    """

    def __init__(self, buffer, memory, tokens_per_rank: int, active_ranks: torch.Tensor,
                 timeout_us: int = 30_000_000):
        self.buffer = buffer
        self.memory = memory
        self.tokens_per_rank = tokens_per_rank
        self.active = active_ranks
        self.timeout_us = timeout_us
        self.num_experts = memory.unified.shape.num_experts
        self.counts: List[Optional[torch.Tensor]] = [None] * memory.unified.num_layers

    def attach(self, model) -> List[torch.nn.Module]:
        """Serve every MoE block of `model` through this runtime (its expert weights are dropped).

        Arguments:
            model: a transformers model whose MoE blocks `models.tiny.moe_blocks` finds, with as many
                MoE layers and the same expert shapes as the `ExpertMemory`.

        Returns:
            originals: list of the replaced `experts` modules, in layer order.

        Raises:
            ValueError: the model's MoE layers do not match the memory.
        """
        from mooncake_ep_switch.models.tiny import moe_blocks

        blocks = moe_blocks(model)
        shape = self.memory.unified.shape
        if len(blocks) != self.memory.unified.num_layers:
            raise ValueError(f"model: expected {self.memory.unified.num_layers} MoE layers, got {len(blocks)}")
        originals = []
        for layer, block in enumerate(blocks):
            experts = block.experts
            if tuple(experts.down_proj.shape) != (shape.num_experts, shape.hidden, shape.intermediate):
                raise ValueError(f"model: layer {layer} experts {tuple(experts.down_proj.shape)} do not match "
                                 f"the memory's {tuple(shape)}")
            originals.append(experts)
            block.experts = ServedExperts(self, layer, experts.act_fn)
        return originals

    def take_counts(self) -> List[Optional[List[int]]]:
        """Per layer, tokens each local physical expert received since the last call (then reset).

        Returns:
            counts: list over layers of a list of int (one per local slot), or None for a layer
                not served in EP with expert slots since the last call.
        """
        counts = [None if c is None else c.tolist() for c in self.counts]
        self.counts = [None] * len(self.counts)
        return counts

    def run(self, experts: ServedExperts, x: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        """One MoE layer for this rank's tokens in the current layout (see the module docstring).

        Arguments:
            experts: the calling `ServedExperts` (layer and expert MLP).
            x: `[N, H]` torch.bfloat16.
            top_k_index: `[N, K]` integer logical expert ids.
            top_k_weights: `[N, K]` floating routing weights.

        Returns:
            out: `[N, H]` torch.bfloat16.
        """
        x = x.to(torch.bfloat16).contiguous()
        idx = top_k_index.to(torch.int64).contiguous()
        weights = top_k_weights.to(torch.float32).contiguous()
        if self.memory.layout == EP:
            return self._ep(experts, x, idx, weights)
        return self._tp(experts, x, idx, weights)

    def _ep(self, experts: ServedExperts, x, idx, weights) -> torch.Tensor:
        from mooncake_ep_switch.eplb.serving import physical_ep_round
        from mooncake_ep_switch.reference.moe_block import ep_round

        memory, layer = self.memory, experts.layer
        if memory.slots is None:  # primaries only: the unified memory's EP view
            gate_up, down = memory.unified.view(layer, EP)
            out, _ = ep_round(self.buffer, x, idx, weights, self.num_experts, gate_up.size(0),
                              lambda local: (gate_up[local], down[local]), self.tokens_per_rank, self.active,
                              self.timeout_us, expert_fn=experts.mlp)
            return out
        out, count = physical_ep_round(self.buffer, x, idx, weights, memory.slots, layer, self.tokens_per_rank,
                                       self.active, memory.dispatch_row(layer), self.timeout_us,
                                       expert_fn=experts.mlp)
        previous = self.counts[layer]
        self.counts[layer] = count.to(torch.int64) if previous is None else previous + count
        return out

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        """Every rank's `[n, H]` float32 rows, rank-major `[R * n, H]`, bit-exact (zeros + one value per row)."""
        memory = self.memory
        n = rows.size(0)
        full = torch.zeros((memory.num_ranks * n, rows.size(1)), dtype=torch.float32)
        full[memory.rank * n:(memory.rank + 1) * n] = rows
        return memory.all_reduce.all_reduce(full, self.active, self.timeout_us, float32_result=True)

    def _tp(self, experts: ServedExperts, x, idx, weights) -> torch.Tensor:
        memory, layer = self.memory, experts.layer
        n, hidden = x.shape
        top_k = idx.size(1)
        if 2 * top_k > hidden:
            raise ValueError(f"top_k_index: expected at most {hidden // 2} experts per token, got {top_k}")
        routing = torch.zeros((n, hidden), dtype=torch.float32)
        routing[:, :top_k] = idx.float()  # small ints: exact in float32
        routing[:, top_k:2 * top_k] = weights
        all_x = self._gather(x.float()).to(torch.bfloat16)
        all_routing = self._gather(routing)
        all_idx = all_routing[:, :top_k].to(torch.int64)
        all_weights = all_routing[:, top_k:2 * top_k]
        gate_up, down = memory.unified.view(layer, "tp")
        part = gate_up.size(1) // 2
        partial = torch.zeros((all_x.size(0), hidden), dtype=torch.float32)
        for expert in all_idx.unique().tolist():
            if expert < 0 or expert >= self.num_experts:
                continue
            token, slot = (all_idx == expert).nonzero(as_tuple=True)
            hidden_states = F.linear(all_x[token], gate_up[expert])
            activated = experts.act_fn(hidden_states[:, :part]) * hidden_states[:, part:]
            y = F.linear(activated.float(), down[expert].float())
            partial.index_add_(0, token, all_weights[token, slot, None] * y)
        out = memory.all_reduce.all_reduce(partial, self.active, self.timeout_us)
        return out[memory.rank * n:(memory.rank + 1) * n].contiguous()
