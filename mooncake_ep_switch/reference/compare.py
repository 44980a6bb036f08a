"""How the demos compare an output with its reference (DeepEP's test metric)."""
import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - a cosine-like similarity of (x + 1) and (y + 1), in float64; 0 when equal.

    Arguments:
        x: a tensor (any dtype, any device).
        y: a tensor of the same shape.

    Returns:
        diff: float.
    """
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())
