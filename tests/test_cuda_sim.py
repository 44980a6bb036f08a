"""The CUDA kernels against the CPU transport's, bit for bit, on two backends:

* `sim`, on every machine: csrc/cuda/ep_kernels.cuh built by the host compiler on the block/warp
  emulator (module `_cuda_sim`), driven through the same launchers as on a GPU;
* `cuda`, on a GPU: the nvcc build (`_cuda`) in this one process, every rank's region in device
  memory (no IPC, no other process: the kernels alone; tests/test_cuda.py runs the transport).

R ranks run in this process, one after another: every rank's send phase, then every rank's receive
phase. The same inputs go through the CPU transport's native kernels (`_native`, what the shm
transport runs) on separate regions, and every output must be identical bit for bit: recv_x rows,
FP8 codes and scales, src_info (its zeroed tail too), layout_range, recv_count, the combined rows,
the masks after timeouts. Structured inputs are also checked against the independent references of
tests/reference.py.
"""
import os
import signal
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional

import pytest
import torch

from mooncake_ep_switch import _cuda_sim as sim
from mooncake_ep_switch import _native
from mooncake_ep_switch.buffer.layout import region_layout
from mooncake_ep_switch.buffer.transport.cuda import _cuda, cuda_unavailable_reason
from mooncake_ep_switch.buffer.transport.one_sided import signal_tag
from tests.reference import (dequantize, expected_combine, expected_routing, expert_scale, fp8_reference,
                             structured_inputs, token_count)

SHORT_US = 5_000  # deadline of the rounds in which a rank does not take part
NO_DEVICE = bool(cuda_unavailable_reason())
# The device backends: the emulator everywhere, the GPU where there is one ("no CUDA device" skips); each
# with the split launches and with the fused ones (Call.fused: MEP_CUDA_FUSED_KERNELS).
ON_GPU = pytest.mark.skipif(NO_DEVICE, reason="no CUDA device")
DEVICES = [pytest.param("sim", id="emulator"), pytest.param("sim-fused", id="emulator-fused"),
           pytest.param("cuda", id="gpu", marks=ON_GPU), pytest.param("cuda-fused", id="gpu-fused", marks=ON_GPU)]


class Shape(NamedTuple):
    num_ranks: int
    tokens: int
    hidden: int
    experts: int
    top_k: int


def _outputs(shape: Shape, use_fp8: bool) -> dict:
    """Fresh receive buffers, poisoned, so that anything a backend leaves unwritten shows."""
    local, rows = shape.experts // shape.num_ranks, shape.num_ranks * shape.tokens
    return {
        "recv_x": torch.full((local, rows, shape.hidden * (1 if use_fp8 else 2)), 0x5A, dtype=torch.uint8),
        "scales": torch.full((local, shape.hidden // 128, rows), -3.0, dtype=torch.float32),
        "src_info": torch.full((local, rows), -7, dtype=torch.int32),
        "layout_range": torch.full((local, shape.num_ranks), -9, dtype=torch.int64),
        "recv_count": torch.full((local,), -11, dtype=torch.int32),
    }


def _mock_expert(rank: int, shape: Shape, out: dict, use_fp8: bool) -> torch.Tensor:
    """Each local expert scales what it received by a power of two (exact in bf16)."""
    local, rows = shape.experts // shape.num_ranks, shape.num_ranks * shape.tokens
    y = torch.zeros((local, rows, shape.hidden), dtype=torch.bfloat16)
    for l_idx in range(local):
        n = int(out["recv_count"][l_idx])
        if use_fp8:
            data = out["recv_x"][l_idx, :n].view(torch.float8_e4m3fn)
            values = dequantize(data, out["scales"][l_idx].t()[:n].contiguous()).to(torch.bfloat16)
        else:
            values = out["recv_x"][l_idx, :n].view(torch.bfloat16)
        y[l_idx, :n] = (values.float() * expert_scale(rank * local + l_idx)).to(torch.bfloat16)
    return y


class Backend:
    """R ranks' regions and per-rank state for one implementation ("native", "sim" or "cuda"; "sim-fused" and
    "cuda-fused" launch the fused kernels).

    The "cuda" backend keeps regions, peer table, counters, call words, scratch, masks and outputs in
    device memory and the control words in pinned host memory (which the device reads and writes).
    """

    def __init__(self, kind: str, shape: Shape, timeout_us: int):
        self.fused = kind.endswith("-fused")
        kind = kind[:-len("-fused")] if self.fused else kind
        self.kind, self.shape, self.timeout_us = kind, shape, timeout_us
        self.mod = _cuda if kind == "cuda" else sim
        self.device = "cuda" if kind == "cuda" else "cpu"
        R = shape.num_ranks
        self.layout = region_layout(R, shape.tokens, shape.hidden, shape.experts)
        self.regions = [torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device) for _ in range(R)]
        self.peer_table = torch.tensor([r.data_ptr() for r in self.regions], dtype=torch.int64, device=self.device)
        L = self.layout
        self.region = self.mod.Region(L.control_bytes, L.half_bytes, L.dispatch_data, L.dispatch_scales,
                                      L.dispatch_src, L.combine_data, L.dispatch_signals, L.combine_signals)
        self.counters = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(R)]
        self.controls = [torch.zeros(1 + 2 * R, dtype=torch.int32, pin_memory=kind == "cuda") for _ in range(R)]
        self.scratch: Dict[tuple, List[torch.Tensor]] = {}
        self.calls: Dict[int, object] = {}
        self.words: Dict[int, torch.Tensor] = {}
        self.dead_words = True  # False: the calls name no peer-watcher words (scripts/gpu_probe.py compares)
        self.reuse_words = False  # True: every dispatch of a rank reuses its call word (as a graph's replays do)
        self.row_warps = self.grid_blocks = 0  # the launches' tuning (Call.row_warps, Call.grid_blocks; 0 = default)

    def stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream if self.kind == "cuda" else 0

    def settle(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize()

    def _call(self, rank: int, number: int, active: torch.Tensor, word: torch.Tensor, advance: int):
        s, R = self.shape, self.shape.num_ranks
        control = self.controls[rank]
        return self.mod.Call(R, rank, s.tokens, s.hidden, s.experts, number & 1, number, self.peer_table.data_ptr(),
                        active.data_ptr(), self.counters[rank].data_ptr(), word.data_ptr(), control.data_ptr(),
                        control.data_ptr() + 4 * (1 + R) if self.dead_words else 0, self.timeout_us, advance,
                        fused=int(self.fused), row_warps=self.row_warps, grid_blocks=self.grid_blocks)

    def dispatch_send(self, rank, number, x, topk, active, use_fp8, advance=0):
        s = self.shape
        if self.kind == "native":
            halves = [r.data_ptr() + self.layout.half_offset(number) for r in self.regions]
            _native.dispatch_send(x.data_ptr(), x.size(0), s.hidden, topk.data_ptr(), topk.size(1), s.experts,
                                  s.num_ranks, rank, s.tokens, active.data_ptr(), halves, signal_tag(number),
                                  use_fp8=use_fp8)
            return
        key = (topk.size(1), rank)
        if key not in self.scratch:
            nbytes = self.mod.dispatch_scratch_bytes(s.num_ranks, s.tokens, s.hidden, s.experts, topk.size(1))
            self.scratch[key] = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        # poisoned, as the transport's torch.empty may leave it: the kernels write every word they read
        word = self.words.get(rank) if self.reuse_words else None
        if word is None:
            word = torch.full((self.mod.call_word_size(s.num_ranks),), -1, dtype=torch.int64, device=self.device)
        self.words[rank] = word
        call = self._call(rank, number, active, word, advance)
        self.calls[rank] = call
        self.mod.dispatch_send(call, self.region, x.data_ptr(), x.size(0), topk.data_ptr(), topk.size(1),
                               use_fp8=use_fp8, scratch=self.scratch[key].data_ptr(), stream=self.stream())
        self.settle()

    def dispatch_recv(self, rank, number, active, use_fp8, top_k, out) -> List[int]:
        s = self.shape
        if self.kind == "native":
            base = self.regions[rank].data_ptr() + self.layout.half_offset(number)
            return list(_native.dispatch_recv(base, s.num_ranks, rank, s.tokens, s.hidden, s.experts,
                                              signal_tag(number), active.data_ptr(), self.timeout_us, use_fp8=use_fp8,
                                              recv_x_ptr=out["recv_x"].data_ptr(),
                                              recv_scales_ptr=out["scales"].data_ptr() if use_fp8 else 0,
                                              src_info_ptr=out["src_info"].data_ptr(),
                                              layout_range_ptr=out["layout_range"].data_ptr(),
                                              recv_count_ptr=out["recv_count"].data_ptr()))
        self.mod.dispatch_recv(self.calls[rank], self.region, use_fp8=use_fp8, top_k=top_k,
                               scratch=self.scratch[(top_k, rank)].data_ptr(), recv_x=out["recv_x"].data_ptr(),
                               recv_scales=out["scales"].data_ptr() if use_fp8 else 0,
                               src_info=out["src_info"].data_ptr(), layout_range=out["layout_range"].data_ptr(),
                               recv_count=out["recv_count"].data_ptr(), stream=self.stream())
        self.settle()
        return self.failed(rank)

    def combine_send(self, rank, number, y, out, active):
        s = self.shape
        if self.kind == "native":
            halves = [r.data_ptr() + self.layout.half_offset(number) for r in self.regions]
            _native.combine_send(y.data_ptr(), s.hidden, s.experts, s.num_ranks, rank, s.tokens,
                                 out["src_info"].data_ptr(), out["layout_range"].data_ptr(), active.data_ptr(), halves,
                                 signal_tag(number))
            return
        call = self._call(rank, number, active, self.words[rank], 0)
        self.calls[rank] = call
        self.mod.combine_send(call, self.region, y.data_ptr(), out["src_info"].data_ptr(),
                              out["layout_range"].data_ptr(), self.stream())
        self.settle()

    def combine_recv(self, rank, number, topk, weights, active, combined, bias=None) -> List[int]:
        s = self.shape
        bias = {} if bias is None else bias  # the reductions' bias keywords (bias0_ptr, ..., bias_hidden)
        if self.kind == "native":
            base = self.regions[rank].data_ptr() + self.layout.half_offset(number)
            return list(_native.combine_recv(base, s.num_ranks, rank, s.tokens, s.hidden, s.experts,
                                             signal_tag(number), active.data_ptr(), self.timeout_us, topk.data_ptr(),
                                             weights.data_ptr(), topk.size(0), topk.size(1), combined.data_ptr(),
                                             **bias))
        self.mod.combine_recv(self.calls[rank], self.region, topk.data_ptr(), weights.data_ptr(), topk.size(0),
                              topk.size(1), combined.data_ptr(), self.stream(), **bias)
        self.settle()
        return self.failed(rank)

    def failed(self, rank) -> List[int]:
        """Sources the device waits flagged (then cleared), as the transport reads them."""
        flags = self.controls[rank][1:1 + self.shape.num_ranks]
        found = torch.nonzero(flags).flatten().tolist()
        flags.zero_()
        return found


def run_round(kind: str, shape: Shape, inputs, number: int, use_fp8: bool, masks: Optional[list] = None,
              absent: tuple = (), leaves_after_dispatch: tuple = (), timeout_us: int = 30_000_000,
              backend: Optional[Backend] = None, advance: int = 0, biases: Optional[list] = None,
              out_offset: int = 0) -> dict:
    """One dispatch + mock experts + combine of every rank on one backend.

    Ranks in `absent` take no part at all; ranks in `leaves_after_dispatch` dispatch and receive but
    never combine. `biases[rank]`: (bias0, bias1, bias_hidden), CPU bf16 `[N, w]` tensors or None whose
    first bias_hidden channels (rows 2 * w bytes apart) that rank's combine starts from. `out_offset`: the
    combine's output starts that many bf16 elements into its allocation (1: 2 bytes off alignment). Returns per-rank
    outputs (on the CPU), masks and the sources each receive marked failed.
    """
    R = shape.num_ranks
    backend = backend or Backend(kind, shape, timeout_us)
    dev = backend.device
    actives = [torch.tensor(masks[r] if masks else [1] * R, dtype=torch.int32, device=dev) for r in range(R)]
    outs = [{k: v.to(dev) for k, v in _outputs(shape, use_fp8).items()} for _ in range(R)]
    xs = [inp.x.to(dev) for inp in inputs]
    topks = [inp.topk_idx.to(dev) for inp in inputs]
    weights = [inp.weights.to(dev) for inp in inputs]
    present = [r for r in range(R) if r not in absent]
    for rank in present:
        backend.dispatch_send(rank, number, xs[rank], topks[rank], actives[rank], use_fp8, advance)
    failed = {r: [] for r in range(R)}
    for rank in present:
        failed[rank] += backend.dispatch_recv(rank, number, actives[rank], use_fp8, topks[rank].size(1), outs[rank])
    after_dispatch = [a.tolist() for a in actives]
    combining = [r for r in present if r not in leaves_after_dispatch]
    ys = {}
    for rank in combining:
        ys[rank] = _mock_expert(rank, shape, {k: v.cpu() for k, v in outs[rank].items()}, use_fp8).to(dev)
        backend.combine_send(rank, number, ys[rank], outs[rank], actives[rank])
    combined = {}
    for rank in combining:
        tokens = inputs[rank].x.size(0)
        flat = torch.full((tokens * shape.hidden + out_offset,), 3.0, dtype=torch.bfloat16, device=dev)
        combined[rank] = flat[out_offset:].view(tokens, shape.hidden)
        bias, parts = None, None  # `parts` holds the bias rows until the (synchronised) receive is done
        if biases is not None:
            parts = [None if b is None else b.to(dev) for b in biases[rank][:2]]
            given = next(b for b in parts if b is not None)
            bias = {"bias0_ptr": 0 if parts[0] is None else parts[0].data_ptr(),
                    "bias1_ptr": 0 if parts[1] is None else parts[1].data_ptr(),
                    "bias_stride": 2 * given.size(1), "bias_hidden": biases[rank][2]}
        failed[rank] += backend.combine_recv(rank, number, topks[rank], weights[rank], actives[rank], combined[rank],
                                             bias)
    return {"outs": [{k: v.cpu() for k, v in out.items()} for out in outs],
            "combined": {r: c.cpu() for r, c in combined.items()}, "after_dispatch": after_dispatch,
            "active": [a.tolist() for a in actives], "failed": failed, "backend": backend}


def _assert_identical(shape: Shape, native: dict, emulated: dict, ranks, use_fp8: bool) -> None:
    for rank in ranks:
        a, b = native["outs"][rank], emulated["outs"][rank]
        assert torch.equal(a["recv_count"], b["recv_count"]), f"rank {rank}: recv_count"
        assert torch.equal(a["layout_range"], b["layout_range"]), f"rank {rank}: layout_range"
        assert torch.equal(a["src_info"], b["src_info"]), f"rank {rank}: src_info (valid rows and zeroed tail)"
        for l_idx in range(a["recv_count"].numel()):
            n = int(a["recv_count"][l_idx])
            assert torch.equal(a["recv_x"][l_idx, :n], b["recv_x"][l_idx, :n]), f"rank {rank} expert {l_idx}: rows"
            if use_fp8:
                assert torch.equal(a["scales"][l_idx, :, :n], b["scales"][l_idx, :, :n]), f"rank {rank}: scales"
        if rank in native["combined"]:
            assert torch.equal(native["combined"][rank].view(torch.int16), emulated["combined"][rank].view(torch.int16)), \
                f"rank {rank}: combined"
    assert native["active"] == emulated["active"], (native["active"], emulated["active"])
    assert native["after_dispatch"] == emulated["after_dispatch"]
    assert {r: sorted(set(v)) for r, v in native["failed"].items()} == \
        {r: sorted(set(v)) for r, v in emulated["failed"].items()}


def _inputs(shape: Shape, seed: int, random_values: bool = False):
    return [structured_inputs(r, token_count(r, shape.num_ranks, shape.tokens), shape.hidden, shape.experts,
                              shape.top_k, seed, random_values=random_values) for r in range(shape.num_ranks)]


# H=2304: rows of 4608 (bf16) and 2304 (FP8) bytes, long enough for warp_copy's four loads in flight a lane
# and its tail; the others' rows take the tail alone.
SHAPES = [Shape(2, 40, 256, 16, 4), Shape(4, 24, 384, 16, 6), Shape(1, 16, 128, 4, 2), Shape(2, 12, 2304, 4, 2)]


def _shape_id(s: Shape) -> str:
    return f"R{s.num_ranks}-T{s.tokens}-H{s.hidden}-E{s.experts}-K{s.top_k}"


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("random_values", [False, True], ids=["structured", "random"])
@pytest.mark.parametrize("device", DEVICES)
def test_kernels_match_the_cpu_transport(device, shape, use_fp8, random_values):
    inputs = _inputs(shape, seed=shape.num_ranks + 3, random_values=random_values)
    number = 7
    native = run_round("native", shape, inputs, number, use_fp8)
    emulated = run_round(device, shape, inputs, number, use_fp8)
    _assert_identical(shape, native, emulated, range(shape.num_ranks), use_fp8)
    local = shape.experts // shape.num_ranks
    everyone = [1] * shape.num_ranks
    for rank in range(shape.num_ranks):  # and right, against the independent references
        out = emulated["outs"][rank]
        routing = expected_routing([inp.topk_idx for inp in inputs], everyone, rank, local)
        assert out["recv_count"].tolist() == [len(pairs) for pairs in routing]
        for l_idx, pairs in enumerate(routing):
            for row, (source, token) in enumerate(pairs):
                assert int(out["src_info"][l_idx, row]) == token
                sent = inputs[source].x[token]
                if use_fp8:
                    data, scales = fp8_reference(sent.view(1, -1))
                    assert torch.equal(out["recv_x"][l_idx, row], data[0].view(torch.uint8))
                    assert torch.equal(out["scales"][l_idx, :, row], scales[0])
                else:
                    assert torch.equal(out["recv_x"][l_idx, row].view(torch.bfloat16), sent)
        if not random_values:
            seen = inputs[rank].x
            if use_fp8:
                data, scales = fp8_reference(seen)
                seen = dequantize(data, scales).to(torch.bfloat16)
            expected = expected_combine(seen, inputs[rank].topk_idx, inputs[rank].weights,
                                        {r: True for r in range(shape.num_ranks)}, local)
            assert torch.equal(emulated["combined"][rank], expected)


@pytest.mark.parametrize("device", DEVICES)
def test_caller_masked_rank_is_neither_sent_to_nor_waited_for(device):
    shape = Shape(4, 24, 256, 16, 4)
    inputs = _inputs(shape, seed=5)
    masks = [[1, 0, 1, 1]] * 4
    native = run_round("native", shape, inputs, 3, False, masks=masks, absent=(1,))
    emulated = run_round(device, shape, inputs, 3, False, masks=masks, absent=(1,))
    _assert_identical(shape, native, emulated, (0, 2, 3), False)
    assert emulated["active"][0] == [1, 0, 1, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("when", ["before_dispatch", "between"])
def test_a_silent_rank_times_out_on_the_device(device, when):
    """Rank 2 never sends (dead before dispatch) or never combines (dead between): the device waits
    expire on the emulated global timer, clear it in active_ranks, flag it for failed_sources, and
    every other row is exactly the CPU transport's."""
    shape = Shape(4, 24, 256, 16, 4)
    inputs = _inputs(shape, seed=8)
    kwargs = dict(absent=(2,)) if when == "before_dispatch" else dict(leaves_after_dispatch=(2,))
    native = run_round("native", shape, inputs, 5, False, timeout_us=SHORT_US, **kwargs)
    emulated = run_round(device, shape, inputs, 5, False, timeout_us=SHORT_US, **kwargs)
    survivors = (0, 1, 3)
    _assert_identical(shape, native, emulated, survivors, False)
    for rank in survivors:
        assert emulated["active"][rank] == [1, 1, 0, 1]
        assert emulated["failed"][rank] == [2]


@pytest.mark.parametrize("device", DEVICES)
def test_dead_word_ends_the_wait_before_the_deadline(device):
    """The peer watcher's verdict (a dead word) fails a silent source without waiting for the deadline:
    with no deadline at all (-1) the wait still ends."""
    shape = Shape(2, 16, 128, 4, 2)
    inputs = _inputs(shape, seed=9)
    backend = Backend(device, shape, -1)
    backend.controls[0][1 + shape.num_ranks + 1] = 1  # rank 0's watcher saw rank 1's process end
    result = run_round(device, shape, inputs, 2, False, absent=(1,), backend=backend)
    assert result["active"][0] == [1, 0]
    assert result["failed"][0] == [1]


@pytest.mark.parametrize("device", DEVICES)
def test_abort_word_ends_a_wait_without_deadline(device):
    shape = Shape(2, 16, 128, 4, 2)
    inputs = _inputs(shape, seed=10)
    backend = Backend(device, shape, -1)
    backend.controls[0][0] = 1  # destroy() raised the abort word
    result = run_round(device, shape, inputs, 2, False, absent=(1,), backend=backend)
    assert result["active"][0] == [1, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_a_count_above_capacity_fails_the_source(device):
    """A corrupted signal (count > T) is a protocol error: the source is failed, nothing read from it."""
    shape = Shape(2, 16, 128, 4, 2)
    inputs = _inputs(shape, seed=12)
    backend = Backend(device, shape, SHORT_US)
    layout = backend.layout
    number = 4
    dev = backend.device
    x, topk = inputs[1].x.to(dev), inputs[1].topk_idx.to(dev)
    active = [torch.ones(2, dtype=torch.int32, device=dev) for _ in range(2)]
    backend.dispatch_send(1, number, x, topk, active[1], False)
    signals = backend.regions[0][layout.half_offset(number) + layout.dispatch_signals:].view(torch.int64)
    L = shape.experts // shape.num_ranks
    signals[1 * L] = (signal_tag(number) << 32) | (shape.tokens + 1)  # rank 1's first signal to rank 0
    backend.dispatch_send(0, number, inputs[0].x.to(dev), inputs[0].topk_idx.to(dev), active[0], False)
    out = {k: v.to(dev) for k, v in _outputs(shape, False).items()}
    failed = backend.dispatch_recv(0, number, active[0], False, topk.size(1), out)
    assert failed == [1] and active[0].tolist() == [1, 0]
    assert out["layout_range"][:, 1].tolist() == [0] * L


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_expert_in_a_row_is_sent_once(device):
    """A token that names one expert twice goes once (the CPU kernels' rule); the combine reads its row
    for both entries."""
    shape = Shape(2, 16, 128, 8, 3)
    inputs = _inputs(shape, seed=13)
    for inp in inputs:
        if inp.topk_idx.size(0):
            inp.topk_idx[0] = torch.tensor([3, 3, 5])
    native = run_round("native", shape, inputs, 6, False)
    emulated = run_round(device, shape, inputs, 6, False)
    _assert_identical(shape, native, emulated, range(2), False)


@pytest.mark.parametrize("device", DEVICES)
def test_graph_mode_advances_the_tag_on_the_device(device):
    """Once a call was captured (advance=1), every replay takes max(last + 1, host call): two replays
    of host call 9 use tags 9 and 10, and both rounds are right."""
    shape = Shape(2, 16, 128, 4, 2)
    backend = Backend(device, shape, 30_000_000)
    for replay, seed in enumerate((20, 21)):
        inputs = _inputs(shape, seed=seed)
        result = run_round(device, shape, inputs, 9, False, backend=backend, advance=1)
        assert [int(backend.words[r][0]) for r in range(2)] == [9 + replay] * 2
        native = run_round("native", shape, inputs, 9 + replay, False)
        # the half stays the one of host call 9 in the emulated rounds; outputs are the same
        _assert_identical(shape, native, result, range(2), False)


# (row_warps, grid_blocks): rows in 2, 3 (uneven parts, a last part shorter) and 8 parts (an FP8 row of 128 bytes
# leaves parts empty); one block per (peer, expert) pair looping over all its rows; more blocks than rows allow
TUNINGS = [pytest.param((2, 0), id="2-warps-a-row"), pytest.param((3, 1), id="3-warps-a-row-one-block-a-pair"),
           pytest.param((8, 100000), id="8-warps-a-row-many-blocks")]


@pytest.mark.parametrize("tuning", TUNINGS)
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], Shape(2, 16, 128, 4, 2)], ids=_shape_id)
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("device", DEVICES)
def test_launch_tuning_gives_the_same_bits(device, shape, use_fp8, tuning):
    """Call.row_warps (warps that share a row's copy) and Call.grid_blocks (blocks the per-(peer, expert) kernels
    aim for) change only how the work is spread: every output is the CPU transport's, bit for bit."""
    inputs = _inputs(shape, seed=shape.num_ranks + 19, random_values=True)
    backend = Backend(device, shape, 30_000_000)
    backend.row_warps, backend.grid_blocks = tuning
    native = run_round("native", shape, inputs, 4, use_fp8)
    emulated = run_round(device, shape, inputs, 4, use_fp8, backend=backend)
    _assert_identical(shape, native, emulated, range(shape.num_ranks), use_fp8)


@pytest.fixture
def blocks_in_reverse():
    """The emulator runs every grid's blocks in descending index order for the test, then ascending again."""
    sim.set_block_order(reversed=True)
    try:
        yield
    finally:
        sim.set_block_order(reversed=False)


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("device", [d for d in DEVICES if d.values[0].startswith("sim")])
def test_outputs_do_not_depend_on_the_order_blocks_run_in(device, shape, use_fp8, blocks_in_reverse):
    """A GPU runs a grid's blocks in any order: with the emulator's blocks in descending order (the fused
    launches' last block to arrive is then block 0, whose own part ran last), every output is still the CPU
    transport's, bit for bit, and a second round on the same backend (its arrival counts reset) too."""
    inputs = _inputs(shape, seed=shape.num_ranks + 11, random_values=True)
    backend = Backend(device, shape, 30_000_000)
    backend.reuse_words = True
    for number in (5, 6):
        native = run_round("native", shape, inputs, number, use_fp8)
        emulated = run_round(device, shape, inputs, number, use_fp8, backend=backend)
        _assert_identical(shape, native, emulated, range(shape.num_ranks), use_fp8)


@pytest.mark.parametrize("device", [d for d in DEVICES if "fused" in d.values[0]])
def test_fused_kernels_leave_their_arrival_counts_at_zero(device):
    """The fused kernels' last block resets its grid's arrival count, so a call word serves every replay of a
    graph: three rounds on the same (first poisoned) call words, every one right, the counts 0 after each."""
    shape = Shape(4, 24, 384, 16, 6)  # combine rows on a (4, 4, z) grid
    backend = Backend(device, shape, 30_000_000)
    backend.reuse_words = True
    for replay, seed in enumerate((40, 41, 42)):
        inputs = _inputs(shape, seed=seed)
        result = run_round(device, shape, inputs, 9, False, backend=backend, advance=1)
        _assert_identical(shape, run_round("native", shape, inputs, 9 + replay, False), result, range(4), False)
        for rank in range(4):
            word = backend.words[rank].cpu()
            assert int(word[0]) == 9 + replay
            assert word[1 + shape.num_ranks:].tolist() == [0, 0, 0], (rank, word.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_eager_tag_is_the_host_call_even_after_a_later_one(device):
    """Eager calls use the host's number exactly (dispatches on two streams keep the host's order)."""
    shape = Shape(1, 8, 128, 2, 1)
    backend = Backend(device, shape, 30_000_000)
    inputs = _inputs(shape, seed=30)
    run_round(device, shape, inputs, 12, False, backend=backend)
    assert int(backend.counters[0][0]) == 12
    run_round(device, shape, inputs, 11, False, backend=backend)  # issued before 12, ran after it
    assert int(backend.words[0][0]) == 11 and int(backend.counters[0][0]) == 12


def _bias_rows(n: int, width: int, generator: torch.Generator) -> torch.Tensor:
    """Random bf16 bias rows with some -0.0 and +0.0 (the sum starts from 0.0f + 1.0f * bias: -0.0 becomes
    +0.0 on the CPU, and must on the device too)."""
    rows = torch.randn(n, width, generator=generator).to(torch.bfloat16)
    if n:
        rows[:, ::7] = -0.0
        rows[:, 3::11] = 0.0
    return rows


def _biased_reference(seen, topk_idx, weights, parts, bias_hidden, local) -> torch.Tensor:
    """`bf16(bias0 + bias1 + sum_k w[t,k] * y(e_k, t))` in fp32 from +0.0, bias first (on the first
    bias_hidden channels), then top-k order; independent of both kernels (tests/reference.py's rule)."""
    out = torch.zeros((topk_idx.size(0), seen.size(1)), dtype=torch.float32)
    for part in parts:
        if part is not None:
            out[:, :bias_hidden] = out[:, :bias_hidden] + 1.0 * part[:, :bias_hidden].float()
    for k in range(topk_idx.size(1)):
        for token in range(topk_idx.size(0)):
            expert = int(topk_idx[token, k])
            if expert < 0:
                continue
            y = (seen[token].float() * expert_scale(expert)).to(torch.bfloat16).float()
            out[token] = out[token] + weights[token, k] * y
    return out.to(torch.bfloat16)


# (which biases, their width, the channels they cover): both over every channel; bias 1 alone over an odd
# number of channels of wider rows (a word of two channels half biased; rows further apart than the channels)
BIAS_CASES = [pytest.param(((True, True), 256, 256), id="two-full"),
              pytest.param(((False, True), 200, 129), id="bias1-129-of-200")]


@pytest.mark.parametrize("case", BIAS_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_combine_starts_from_the_bias_as_the_cpu_does(device, case):
    """The device combine's sum starts from bias 0 then bias 1 (weight 1, read in place), bit for bit the
    CPU transport's combine_recv with the same bias, and right against an independent reference."""
    which, width, bias_hidden = case
    shape = Shape(2, 24, 256, 8, 4)
    inputs = _inputs(shape, seed=17)
    for inp in inputs:  # a token that selects nothing: its sum is the bias alone (-0.0 channels give +0.0)
        if inp.topk_idx.size(0):
            inp.topk_idx[-1] = -1
    g = torch.Generator().manual_seed(5)
    biases = [tuple(_bias_rows(inp.x.size(0), width, g) if on else None for on in which) + (bias_hidden,)
              for inp in inputs]
    if all(which):  # +2^24 then -2^24 on channels 8-15: first, they cancel exactly; added after the rows
        for bias0, bias1, _ in biases:  # (or between), the rows' sum would be rounded to an even integer
            bias0[:, 8:16], bias1[:, 8:16] = 2.0 ** 24, -2.0 ** 24
    native = run_round("native", shape, inputs, 5, False, biases=biases)
    emulated = run_round(device, shape, inputs, 5, False, biases=biases)
    _assert_identical(shape, native, emulated, range(2), False)
    plain = run_round("native", shape, inputs, 5, False)
    for rank, inp in enumerate(inputs):
        got = emulated["combined"][rank]
        assert torch.equal(got.view(torch.int16),
                           _biased_reference(inp.x, inp.topk_idx, inp.weights, biases[rank][:2], bias_hidden,
                                             shape.experts // shape.num_ranks).view(torch.int16)), rank
        if inp.x.size(0):  # the bias changed the biased channels, and only those
            assert not torch.equal(got[:, :bias_hidden], plain["combined"][rank][:, :bias_hidden])
            assert torch.equal(got[:, bias_hidden:], plain["combined"][rank][:, bias_hidden:])


@pytest.mark.parametrize("offset", [1, 4], ids=["out-2-bytes-off", "out-8-bytes-off"])
@pytest.mark.parametrize("device", DEVICES)
def test_combine_into_a_misaligned_output_gives_the_same_bits(device, offset):
    """k_combine_reduce sums 8 channels a thread with one 16-byte load per row where the rows and the output are
    16-byte aligned (every other test here), else 2 channels a thread with 4-byte loads: an output 2 or 8 bytes
    past a 16-byte boundary takes the narrow path, bit for bit the CPU transport's combine and the wide path's
    result (K=6: a partial group of rows in flight; random values, a masked-out expert row per token)."""
    shape = Shape(4, 24, 384, 16, 6)
    inputs = _inputs(shape, seed=23, random_values=True)
    for inp in inputs:
        if inp.topk_idx.size(0):
            inp.topk_idx[:, 2] = -1
    native = run_round("native", shape, inputs, 3, False, out_offset=offset)
    emulated = run_round(device, shape, inputs, 3, False, out_offset=offset)
    aligned = run_round(device, shape, inputs, 3, False)
    _assert_identical(shape, native, emulated, range(shape.num_ranks), False)
    for rank in range(shape.num_ranks):
        assert torch.equal(emulated["combined"][rank].view(torch.int16), aligned["combined"][rank].view(torch.int16))


@pytest.mark.parametrize("offset", [0, 4, 8], ids=["aligned", "4-bytes-off", "8-bytes-off"])
def test_the_emulator_traps_a_misaligned_wide_access_as_the_gpu_faults(offset):
    """A GPU faults on a 16-byte access off a 16-byte boundary (cudaErrorMisalignedAddress, a dead context);
    x86 lets it pass, so the emulator checks every typed access's alignment and traps (setup.py's flags).
    Without them a kernel's misaligned store passed CI and first faulted on an H200 (docs/benchmarks.md,
    2026-11-29). One 16-byte load, in a child process: an aligned one reads, any other is killed by SIGILL."""
    code = ("import ctypes; from mooncake_ep_switch import _cuda_sim as sim\n"
            "words = (ctypes.c_int32 * 16)(*range(16))\n"
            "base = (ctypes.addressof(words) + 15) // 16 * 16\n"
            "first = (base - ctypes.addressof(words)) // 4 + OFFSET // 4\n"
            "got = sim.load_int4(base + OFFSET)\n"
            "assert got == sum(range(first, first + 4)), got\n"
            "print('read', got)\n").replace("OFFSET", str(offset))
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if offset == 0:
        assert child.returncode == 0 and child.stdout.startswith("read "), (child.returncode, child.stderr[-2000:])
    else:
        assert child.returncode == -signal.SIGILL, (child.returncode, child.stdout, child.stderr[-2000:])


def test_the_fused_launches_are_a_setting_off_by_default(monkeypatch):
    """MEP_CUDA_FUSED_KERNELS (config.py, the one place the environment is read): off unset, "1" on, else refused
    by name."""
    from mooncake_ep_switch.config import settings

    monkeypatch.delenv("MEP_CUDA_FUSED_KERNELS", raising=False)
    assert settings().cuda_fused_kernels is False
    monkeypatch.setenv("MEP_CUDA_FUSED_KERNELS", "1")
    assert settings().cuda_fused_kernels is True
    monkeypatch.setenv("MEP_CUDA_FUSED_KERNELS", "yes")
    with pytest.raises(ValueError, match="MEP_CUDA_FUSED_KERNELS: expected '0' or '1', got 'yes'"):
        settings()


def test_the_probe_and_check_scripts_run_their_dry_runs():
    """scripts/gpu_probe.py (what a lent GPU's few minutes run) on the emulator at tiny shapes: both launch
    variants bit-exact against the CPU kernels and timed; and scripts/gpu_check.sh parses."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probe = subprocess.run([sys.executable, "scripts/gpu_probe.py", "--sim", "--iters", "1", "--sweep"],
                           capture_output=True, text=True, timeout=300, cwd=root)
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-3000:]
    for line in ("EXACT bf16 Shape", "EXACT fp8 fused Shape", "TIME bf16 fused Shape", "LARGE fused Shape",
                 "PROFILE bf16 fused row_warps=4 grid_blocks=1056", "SWEEP best", "PROBE OK"):
        assert line in probe.stdout, (line, probe.stdout[-3000:])
    assert "MISMATCH" not in probe.stdout
    syntax = subprocess.run(["bash", "-n", "scripts/gpu_check.sh"], capture_output=True, text=True, timeout=60,
                            cwd=root)
    assert syntax.returncode == 0, syntax.stderr


def test_combine_launcher_refuses_bad_bias_arguments():
    """bias_hidden outside [1, hidden], a stride under its rows or odd, an odd address: refused by name
    before anything is launched."""
    backend = Backend("sim", Shape(2, 8, 128, 4, 2), 1000)
    call = sim.Call(2, 0, 8, 128, 4, 0, 1, 1, 1, 1, 1, 1, 0, 1000, 0)  # never launched: checked first
    bias = torch.zeros(8, 128, dtype=torch.bfloat16)
    good = dict(bias0_ptr=bias.data_ptr(), bias1_ptr=0, bias_stride=256, bias_hidden=128)
    for name, change in (("bias_hidden", dict(bias_hidden=0)), ("bias_hidden", dict(bias_hidden=129)),
                         ("bias_stride", dict(bias_stride=254)), ("bias_stride", dict(bias_stride=257)),
                         ("bias0_ptr", dict(bias0_ptr=bias.data_ptr() + 1))):
        with pytest.raises(ValueError, match=name):
            sim.combine_recv(call, backend.region, 1, 1, 1, 1, 1, 0, **{**good, **change})
    assert all(int(region.count_nonzero()) == 0 for region in backend.regions)


def test_value_check_kernel_names_the_problem():
    shape = Shape(2, 8, 128, 8, 2)
    problem = torch.zeros(4, dtype=torch.int32)
    topk = torch.tensor([[0, 1], [2, 9]], dtype=torch.int64)
    active = torch.ones(2, dtype=torch.int32)
    sim.check_values(topk.data_ptr(), 2, 2, shape.experts, active.data_ptr(), 2, problem.data_ptr(), 0)
    assert problem.tolist() == [1, 1, 1, 9]
    problem.zero_()
    topk = torch.tensor([[4, 4], [2, -1]], dtype=torch.int64)
    sim.check_values(topk.data_ptr(), 2, 2, shape.experts, active.data_ptr(), 2, problem.data_ptr(), 0)
    assert problem.tolist() == [2, 0, 1, 4]
    problem.zero_()
    topk = torch.tensor([[4, -1], [2, -1]], dtype=torch.int64)
    active[1] = 2
    sim.check_values(topk.data_ptr(), 2, 2, shape.experts, active.data_ptr(), 2, problem.data_ptr(), 0)
    assert problem.tolist() == [3, 1, 0, 2]


def test_launchers_refuse_out_of_range_shapes():
    """The launchers check what they launch (nothing is launched, nothing written)."""
    shape = Shape(2, 8, 128, 4, 2)
    backend = Backend("sim", shape, 1000)
    x = torch.zeros((9, 128), dtype=torch.bfloat16)  # more tokens than T
    topk = torch.zeros((9, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match="num_tokens"):
        backend.dispatch_send(0, 1, x, topk, torch.ones(2, dtype=torch.int32), False)
    outside = sim.Call(2, 2, 8, 128, 4, 0, 1, 1, 1, 1, 1, 1, 0, 1000, 0)  # rank 2 of 2
    with pytest.raises(ValueError, match="rank 2 outside"):
        sim.dispatch_send(outside, backend.region, 1, 0, 1, 1, use_fp8=False, scratch=1, stream=0)
    not_a_flag = sim.Call(2, 0, 8, 128, 4, 0, 1, 1, 1, 1, 1, 1, 0, 1000, 0, fused=2)
    with pytest.raises(ValueError, match="fused"):
        sim.dispatch_send(not_a_flag, backend.region, 1, 0, 1, 1, use_fp8=False, scratch=1, stream=0)
    with pytest.raises(ValueError, match="num_ranks"):
        sim.call_word_size(0)
    assert sim.call_word_size(8) == 1 + 8 + 3
    for name, tuning in (("row_warps", dict(row_warps=33)), ("row_warps", dict(row_warps=-1)),
                         ("grid_blocks", dict(grid_blocks=-2))):
        bad = sim.Call(2, 0, 8, 128, 4, 0, 1, 1, 1, 1, 1, 1, 0, 1000, 0, **tuning)
        with pytest.raises(ValueError, match=name):
            sim.dispatch_send(bad, backend.region, 1, 0, 1, 1, use_fp8=False, scratch=1, stream=0)
    odd_hidden = sim.Call(2, 0, 8, 100, 4, 0, 1, 1, 1, 1, 1, 1, 0, 1000, 0)
    with pytest.raises(ValueError, match="hidden"):
        sim.combine_recv(odd_hidden, backend.region, 1, 1, 1, 1, 1, 0)
    assert all(int(region.count_nonzero()) == 0 for region in backend.regions)
