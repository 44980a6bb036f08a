"""The two MoE layouts' names.

`TP` (tensor parallel: every rank holds a slice of every expert) and `EP` (expert parallel: every
rank holds whole experts) are the layouts a MoE layer is served in; `LAYOUTS[i]` is also the layout's
code in the simulator's plans (0 = TP, 1 = EP). ("Layout" means only this: the EP region's byte
layout is `buffer.layout.RegionLayout`, EPLB's slot tables are placements.) This module imports
nothing, so every room can use it.
"""

TP = "tp"  # tensor parallel: every rank holds a slice of every expert
EP = "ep"  # expert parallel: every rank holds whole experts
LAYOUTS = (TP, EP)
