"""The two MoE layouts a layer is served in, named once for the whole switch package.

`LAYOUTS[i]` is also the layout's code in the simulator's plans (0 = TP, 1 = EP).
"""

TP = "tp"  # tensor parallel: every rank holds a slice of every expert
EP = "ep"  # expert parallel: every rank holds whole experts
LAYOUTS = (TP, EP)
