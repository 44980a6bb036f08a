"""EPLB policy: pure placement (which logical expert each physical expert, or slot, holds), no state.

Given loads, it decides; it touches no Buffer, region or process: replica counts
(`replication`), construction and refinement (`construct`, `packing`, `local_search`), the
movement-aware rebalance (`incremental`, `alignment`, `previous`), redundant experts around fixed
primaries (`redundant`), how many slots to spend (`budget`), quality measures (`metrics`), the
classic DeepSeek greedy baseline (`greedy`), the result type (`tables.Placement`), and the entry
points (`placement.rebalance_experts`, `compat.rebalance_experts`). The runtime that records loads
and moves weights (recorder, maps, slots, online, serving) is the parent package `eplb`.
"""
