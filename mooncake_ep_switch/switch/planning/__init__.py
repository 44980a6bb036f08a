"""When to switch: the TP<->EP policy, the cost-model simulator and its traces (no runtime state).

`policy.SwitchPolicy` decides from the request count and a calibrated cost model; `simulator`
replays a trace under that model (the Moebius paper's comparison); `traces` builds the traces.
The runtime that moves weights and KV (unified, reshard, kv_*, switcher, tp_collective) is the parent
package `switch`.
"""
