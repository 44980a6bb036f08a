"""Reference model code the tests, the demo and the benchmarks serve: a MoE block and an attention layer.

Not part of the data plane: `moe_block` (router, expert MLPs in the EP and TP layouts, the
single-process reference) and `attention` (paged attention over the KV cache that switches move).
"""
