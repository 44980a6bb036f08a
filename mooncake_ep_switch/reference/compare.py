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


# Logits of one bf16 model computed by other kernels (another CPU's bf16 GEMMs, other batch or matmul
# shapes, ATEN_CPU_CAPABILITY) round differently: every bf16 result may move by a rounding (relative
# 2^-8) and the moves compound through the layers. Measured on the tiny models (ATEN_CPU_CAPABILITY
# default vs avx2, reference generations): at most 3.5 roundings of a row's largest logit; allowed: 16.
BF16_UNIT_ROUNDOFF = 2.0 ** -8
KERNEL_ROUNDINGS = 16


def kernel_tolerance(reference: torch.Tensor) -> torch.Tensor:
    """How far each logit of a row may move when other kernels compute the same bf16 model.

    Arguments:
        reference: `[B, V]` logits (any float dtype).

    Returns:
        tolerance: `[B, 1]` torch.float64, `KERNEL_ROUNDINGS * 2^-8 * max |row|`.
    """
    return KERNEL_ROUNDINGS * BF16_UNIT_ROUNDOFF * reference.double().abs().amax(-1, keepdim=True)


class GreedyComparison:
    """A greedy generation against its reference, step by step, on any CPU.

    A served token equals the reference's unless the reference's logits of the two tokens are a
    near-tie (within twice `kernel_tolerance`): other kernels may then pick the other one, exactly
    as the model itself would on another CPU. Such a sequence continues from other inputs than the
    reference's, so it is not compared from the next step on.
    """

    def __init__(self):
        self.diverged = {}  # sequence index -> the step at whose near-tie it took the other token

    def step(self, step: int, rows, tokens, reference_logits: torch.Tensor, reference_tokens):
        """Compare one step's tokens; say which rows are still comparable.

        Arguments:
            step: the step number.
            rows: the sequence index of each served row.
            tokens: the token each served row chose.
            reference_logits: `[B, V]` the reference's logits of every sequence at this step.
            reference_tokens: the reference's token of every sequence (B ids).

        Returns:
            kept: positions in `rows` whose logits compare with the reference's at this step (their
                sequences took the reference's tokens so far).
            wrong: sequence indices whose token differs from the reference's beyond a near-tie.
        """
        kept = [i for i, row in enumerate(rows) if row not in self.diverged]
        wrong = []
        for i in kept:
            row, got, want = rows[i], int(tokens[i]), int(reference_tokens[rows[i]])
            if got == want:
                continue
            values = reference_logits[row:row + 1].double()
            if float(values[0, want] - values[0, got]) <= 2 * float(kernel_tolerance(values)):
                self.diverged[row] = step
            else:
                wrong.append(row)
        return kept, wrong
