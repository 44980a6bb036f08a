"""Per-step expert load recording: sliding-window or exponential-moving-average token counts.

The engine records, for every step, how many tokens each physical slot of each MoE layer
received. In window mode the recorder keeps the last `window_size` steps exactly (a ring buffer)
and their sum; in EMA mode it keeps `ema = decay * ema + (1 - decay) * counts`, which tracks
popularity with memory ~1 / (1 - decay) steps and needs no buffer.

Counts live in physical-slot space, so after a rebalance the history refers to the old slot
table: call `remap(old_phy2log, new_phy2log)` to carry it over (each logical expert's count is
split evenly across its new copies) or `reset()` to start over.
"""
import logging
from typing import NamedTuple, Optional

import numpy as np

from mooncake_ep_switch.checks import check_int
from mooncake_ep_switch.eplb._convert import as_float, as_indices, as_loads, to_numpy
from mooncake_ep_switch.eplb.policy.tables import Placement, expert_counts
from mooncake_ep_switch.eplb.policy.metrics import balance_of_loads

logger = logging.getLogger(__name__)

_MODES = ("window", "ema")


class LoadBalance(NamedTuple):
    """Measured balancedness of the recorded load.

    Arguments:
        per_layer: `[L]` float64 numpy array, mean GPU load / max GPU load per layer (1.0 for a
            layer with no load).
        mean: the mean over layers.
    """

    per_layer: np.ndarray
    mean: float


def counts_from_topk(topk_idx, num_physical: int) -> np.ndarray:
    """Token counts per physical slot from physical top-k indices.

    Arguments:
        topk_idx: `[..., N, K]` integer torch tensor or numpy array of physical slot ids; -1
            entries (no expert) are ignored. With a leading layer dimension `[L, N, K]` the
            result has one row per layer.
        num_physical: the number of physical slots per layer.

    Returns:
        counts: `[num_physical]` (for `[N, K]` input) or `[L, num_physical]` (for `[L, N, K]`)
            int64 numpy array.
    """
    num_physical = check_int("num_physical", num_physical, 1)
    array = to_numpy("topk_idx", topk_idx)
    if array.ndim not in (2, 3):
        raise ValueError(f"topk_idx: expected [N, K] or [L, N, K], got {array.ndim} dimensions")
    index = as_indices("topk_idx", array, array.ndim, upper=num_physical, allow_negative_one=True)
    if index.ndim == 2:
        valid = index[index >= 0]
        return np.bincount(valid, minlength=num_physical).astype(np.int64)
    layers = index.shape[0]
    offsets = (np.arange(layers, dtype=np.int64) * num_physical)[:, None, None]
    flat = (index + offsets)[index >= 0]
    return np.bincount(flat, minlength=layers * num_physical).reshape(layers, num_physical).astype(np.int64)


class ExpertLoadRecorder:
    """Records per-layer, per-physical-slot token counts and decides when to rebalance.

    Arguments:
        num_layers: L, MoE layers.
        num_physical_experts: physical slots per layer (a multiple of `num_gpus`).
        num_gpus: GPUs (EP ranks); slot s is on GPU `s // (num_physical_experts // num_gpus)`.
        window_size: steps kept in window mode.
        rebalance_interval: `should_rebalance` is true every this many steps.
        mode: "window" (exact sliding-window sum) or "ema" (exponential moving average).
        ema_decay: weight of the past in EMA mode, in [0, 1).
    """

    def __init__(
        self,
        num_layers: int,
        num_physical_experts: int,
        num_gpus: int,
        window_size: int = 1000,
        rebalance_interval: int = 3000,
        mode: str = "window",
        ema_decay: float = 0.999,
    ):
        self.num_layers = check_int("num_layers", num_layers, 1)
        self.num_physical_experts = check_int("num_physical_experts", num_physical_experts, 1)
        self.num_gpus = check_int("num_gpus", num_gpus, 1)
        if self.num_physical_experts % self.num_gpus:
            raise ValueError(
                f"num_physical_experts: expected a multiple of num_gpus={self.num_gpus}, got {self.num_physical_experts}"
            )
        self.window_size = check_int("window_size", window_size, 1)
        self.rebalance_interval = check_int("rebalance_interval", rebalance_interval, 1)
        if mode not in _MODES:
            raise ValueError(f"mode: expected one of {_MODES}, got {mode!r}")
        self.mode = mode
        self.ema_decay = as_float("ema_decay", ema_decay, 0.0, 1.0)
        if self.ema_decay >= 1.0:
            raise ValueError(f"ema_decay: expected a number in [0, 1), got {self.ema_decay!r}")
        self.step = 0
        shape = (self.num_layers, self.num_physical_experts)
        self._pending = np.zeros(shape, dtype=np.int64)
        self._pending_used = False
        if mode == "window":
            # Token counts per step fit int32; the running sum is int64.
            self._ring = np.zeros((self.window_size,) + shape, dtype=np.int32)
            self._sum = np.zeros(shape, dtype=np.int64)
            self._filled = 0
        else:
            self._ema = np.zeros(shape, dtype=np.float64)

    # Recording --------------------------------------------------------------------------------

    def record(self, counts) -> None:
        """Record one step from per-slot token counts of every layer.

        Arguments:
            counts: `[L, num_physical_experts]` torch tensor or numpy array of non-negative
                integer (or integral float) token counts.
        """
        values = as_loads("counts", counts, 2)
        if values.shape != (self.num_layers, self.num_physical_experts):
            raise ValueError(
                f"counts: expected shape [{self.num_layers}, {self.num_physical_experts}], got {list(values.shape)}"
            )
        if self._pending_used:
            raise RuntimeError("record: a step assembled with record_layer() is open; call end_step() first")
        self._commit(values)

    def record_topk(self, topk_idx) -> None:
        """Record one step from the physical top-k indices of every layer.

        Arguments:
            topk_idx: `[L, N, K]` integer torch tensor or numpy array of physical slot ids, -1 for none.
        """
        array = to_numpy("topk_idx", topk_idx)
        if array.ndim != 3 or array.shape[0] != self.num_layers:
            raise ValueError(f"topk_idx: expected shape [{self.num_layers}, N, K], got {list(array.shape)}")
        self.record(counts_from_topk(array, self.num_physical_experts))

    def record_layer(self, layer: int, topk_idx) -> None:
        """Add one layer's physical top-k indices to the step being assembled (see `end_step`).

        Arguments:
            layer: the MoE layer, in [0, L).
            topk_idx: `[N, K]` integer torch tensor or numpy array of physical slot ids, -1 for none.
        """
        layer = check_int("layer", layer, 0)
        if layer >= self.num_layers:
            raise ValueError(f"layer: expected < {self.num_layers}, got {layer}")
        self._pending[layer] += counts_from_topk(topk_idx, self.num_physical_experts)
        self._pending_used = True

    def end_step(self) -> None:
        """Close the step assembled with `record_layer` (an empty step if nothing was added)."""
        values = self._pending.astype(np.float64)
        self._pending[:] = 0
        self._pending_used = False
        self._commit(values)

    def _commit(self, values: np.ndarray) -> None:
        if self.mode == "window":
            slot = self.step % self.window_size
            self._sum -= self._ring[slot]
            self._ring[slot] = np.rint(values).astype(np.int32)
            self._sum += self._ring[slot]
            self._filled = min(self._filled + 1, self.window_size)
        else:
            self._ema *= self.ema_decay
            self._ema += (1.0 - self.ema_decay) * values
        self.step += 1

    # Reading ----------------------------------------------------------------------------------

    def physical_load(self) -> np.ndarray:
        """The recorded load per physical slot.

        Returns:
            load: `[L, num_physical_experts]` float64 numpy array: the sum over the window
                (window mode) or the moving average (EMA mode).
        """
        return self._sum.astype(np.float64) if self.mode == "window" else self._ema.copy()

    def logical_load(self, phy2log, num_logical: int) -> np.ndarray:
        """The recorded load per logical expert (the sum over its physical copies).

        Arguments:
            phy2log: `[L, num_physical_experts]` integer torch tensor or numpy array (or a
                `Placement`), the slot table the counts were recorded under.
            num_logical: E.

        Returns:
            load: `[L, E]` float64 numpy array, the input `weight` for `rebalance_experts`.
        """
        if isinstance(phy2log, Placement):
            phy2log = phy2log.phy2log
        num_logical = check_int("num_logical", num_logical, 1)
        table = as_indices("phy2log", phy2log, 2, upper=num_logical)
        if table.shape != (self.num_layers, self.num_physical_experts):
            raise ValueError(
                f"phy2log: expected shape [{self.num_layers}, {self.num_physical_experts}], got {list(table.shape)}"
            )
        load = np.zeros((self.num_layers, num_logical))
        np.add.at(load, (np.arange(self.num_layers)[:, None].repeat(table.shape[1], 1), table), self.physical_load())
        return load

    def gpu_load(self) -> np.ndarray:
        """The recorded load per GPU.

        Returns:
            load: `[L, num_gpus]` float64 numpy array.
        """
        return self.physical_load().reshape(self.num_layers, self.num_gpus, -1).sum(axis=2)

    def balancedness(self) -> LoadBalance:
        """Measured balancedness (mean GPU load / max GPU load) per layer and its mean; logged.

        Returns:
            balance: a `LoadBalance` NamedTuple.
        """
        per_layer = balance_of_loads(self.gpu_load())
        mean = float(per_layer.mean()) if per_layer.size else 1.0
        logger.info("EPLB step %d: balancedness %.4f (min layer %.4f)", self.step, mean, float(per_layer.min(initial=1.0)))
        return LoadBalance(per_layer, mean)

    def should_rebalance(self, step: Optional[int] = None) -> bool:
        """Whether a rebalance is due: every `rebalance_interval` steps, once anything was recorded.

        Arguments:
            step: the engine's step count, or None for the number of steps recorded here.

        Returns:
            due: True when `step > 0` and `step % rebalance_interval == 0`.
        """
        step = self.step if step is None else check_int("step", step, 0)
        return step > 0 and step % self.rebalance_interval == 0

    # After a rebalance ------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget all recorded load (the step counter keeps counting)."""
        if self.mode == "window":
            self._ring[:] = 0
            self._sum[:] = 0
            self._filled = 0
        else:
            self._ema[:] = 0.0
        self._pending[:] = 0
        self._pending_used = False

    def remap(self, old_phy2log, new_phy2log) -> None:
        """Carry the recorded load over to a new slot table.

        Each step's (or the EMA's) count of a logical expert, summed over its old copies, is
        split evenly over its new copies; in window mode the integer remainder goes to the
        lowest-numbered copies, so per-expert totals are kept exactly.

        Arguments:
            old_phy2log: `[L, P]` integer torch tensor or numpy array (or a `Placement`), the
                table the counts were recorded under.
            new_phy2log: `[L, P]` integer torch tensor or numpy array (or a `Placement`), the
                table now deployed; must contain every logical expert of `old_phy2log`.
        """
        tables = []
        for name, table in (("old_phy2log", old_phy2log), ("new_phy2log", new_phy2log)):
            if isinstance(table, Placement):
                table = table.phy2log
            table = as_indices(name, table, 2, upper=self.num_physical_experts)  # E <= P: ids are < P
            if table.shape != (self.num_layers, self.num_physical_experts):
                raise ValueError(
                    f"{name}: expected shape [{self.num_layers}, {self.num_physical_experts}], got {list(table.shape)}"
                )
            tables.append(table)
        old, new = tables
        num_logical = int(max(old.max(initial=0), new.max(initial=0))) + 1
        new_count = expert_counts(new, num_logical)
        old_count = expert_counts(old, num_logical)
        lost = (old_count > 0) & (new_count == 0)
        if lost.any():
            layer, expert = (int(v[0]) for v in np.nonzero(lost))
            raise ValueError(f"new_phy2log: expected every logical expert of old_phy2log, layer {layer} lacks expert {expert}")
        rows = np.arange(self.num_layers)[:, None]
        # Rank of each new slot among its expert's copies (0 for the lowest slot id).
        order = np.argsort(new, axis=1, kind="stable")
        sorted_experts = np.take_along_axis(new, order, axis=1)
        run_start = np.cumsum(new_count, axis=1) - new_count
        rank = np.empty_like(new)
        np.put_along_axis(rank, order, np.arange(new.shape[1])[None, :] - np.take_along_axis(run_start, sorted_experts, axis=1), axis=1)
        copies = new_count[rows, new]

        layer_offset = (np.arange(self.num_layers, dtype=np.int64) * num_logical)[:, None]
        old_flat = (old + layer_offset).ravel()  # [L * P] index into [L, E]
        new_flat = (new + layer_offset).ravel()
        size = self.num_layers * num_logical

        def convert(values: np.ndarray, integral: bool) -> np.ndarray:
            # values: [n, L, P] in old slot space -> [n, L, P] in new slot space, in chunks.
            out = np.empty(values.shape, dtype=np.int64 if integral else np.float64)
            for start in range(0, values.shape[0], 64):
                chunk = values[start:start + 64].reshape(-1, old_flat.size)
                n = chunk.shape[0]
                index = (np.arange(n, dtype=np.int64)[:, None] * size + old_flat[None, :]).ravel()
                logical = np.bincount(index, weights=chunk.ravel().astype(np.float64), minlength=n * size).reshape(n, size)
                total = logical[:, new_flat].reshape(n, self.num_layers, self.num_physical_experts)
                if integral:
                    whole = np.rint(total).astype(np.int64)
                    out[start:start + n] = whole // copies + (rank < whole % copies)
                else:
                    out[start:start + n] = total / copies
            return out

        if self.mode == "window":
            self._ring[:] = convert(self._ring.astype(np.int64), True).astype(np.int32)
            self._sum[:] = self._ring.sum(axis=0, dtype=np.int64)
        else:
            self._ema[:] = convert(self._ema[None], False)[0]
