"""The modules one warm `Buffer.dispatch()` passes through (issue 24's walk), for a transport.

Usage: python scripts/dispatch_walk.py shm|collective   (one rank, gloo on loopback)

Two readings of one traced call (sys.setprofile, the package's own modules only):
  calls only: the module of every function the call enters, in order (consecutive repeats collapse);
  calls and returns: also the module control returns to (the hub's round trips count).
"""
import argparse
import sys, os

_parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_parser.add_argument("transport", choices=["shm", "collective"], help="the Buffer's transport to trace")
TRANSPORT = _parser.parse_args().transport

import torch, torch.distributed as dist
try:
    from mooncake_ep_switch.launcher.launch import host_store
except ImportError:  # the layout before issue 24 (for the before/after comparison)
    from mooncake_ep_switch.launch import host_store
store = host_store("127.0.0.1", 0, 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
from mooncake_ep_switch import Buffer
import mooncake_ep_switch
ROOT = os.path.dirname(mooncake_ep_switch.__file__) + "/"
T, H, E = 8, 256, 4
buf = Buffer(dist.group.WORLD, Buffer.get_ep_buffer_size_hint(T, H, 1, E), transport=TRANSPORT)
x = (torch.arange(4 * H) % 7).view(4, H).to(torch.bfloat16)
topk = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]])
active = torch.ones(1, dtype=torch.int32)
for _ in range(3):
    out = buf.dispatch(x, topk, active, T, E, timeout_us=1_000_000)
    del out
seq, calls = [], []
def mod(frame):
    f = frame.f_code.co_filename if frame else ""
    return f[len(ROOT):] if f.startswith(ROOT) else None
def prof(frame, event, arg):
    if event == "call":
        m = mod(frame)
        if m and (not calls or calls[-1] != m):
            calls.append(m)
    elif event == "return":
        m = mod(frame.f_back)
    else:
        return
    if m and (not seq or seq[-1] != m):
        seq.append(m)
sys.setprofile(prof)
out = buf.dispatch(x, topk, active, T, E, timeout_us=1_000_000)
sys.setprofile(None)
rooms = len(set(seq))
print(" -> ".join(seq))
print(f"calls and returns: stays {len(seq)}, modules {rooms}, returns to a module already left {len(seq) - rooms}")
print("calls only: " + " -> ".join(calls))
print(f"calls only: stays {len(calls)}, modules {len(set(calls))}, re-entered {len(calls) - len(set(calls))}")
buf.destroy()
