"""Argument conversion and validation shared by the EPLB modules.

Every public EPLB function accepts torch tensors or numpy arrays and works internally on numpy.
The helpers here convert and check one argument each, and raise errors that name the argument,
what was expected and what came.
"""
import numbers
import os
from typing import Optional

import numpy as np
import torch


def describe(value) -> str:
    """A short description of a value for error messages: type, shape and dtype.

    Arguments:
        value: any object; torch tensors and numpy arrays are described by shape and dtype, anything
            else by type name and repr.

    Returns:
        text: the description, e.g. "torch.Tensor of shape [4, 8] and dtype torch.int64".
    """
    if isinstance(value, torch.Tensor):
        return f"torch.Tensor of shape {list(value.shape)} and dtype {value.dtype}"
    if isinstance(value, np.ndarray):
        return f"numpy.ndarray of shape {list(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__} {value!r}"


def to_numpy(name: str, value) -> np.ndarray:
    """Convert a torch tensor, numpy array or nested sequence to a numpy array (no copy if possible).

    Arguments:
        name: the argument's name, for error messages.
        value: a torch tensor (any device), numpy array, or nested list of numbers.

    Returns:
        array: the same values as a numpy array.
    """
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.is_floating_point() and tensor.dtype not in (torch.float16, torch.float32, torch.float64):
            tensor = tensor.double()  # bfloat16, float8: no numpy equivalent
        return tensor.numpy()
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        try:
            return np.asarray(value)
        except ValueError as exc:
            raise TypeError(f"{name}: expected a rectangular array, got a ragged {type(value).__name__}") from exc
    raise TypeError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {describe(value)}")


def as_loads(name: str, value, ndim: int) -> np.ndarray:
    """Convert non-negative finite real loads to a float64 numpy array of a given rank.

    Arguments:
        name: the argument's name, for error messages.
        value: torch tensor or numpy array of any real dtype (bool and complex are refused).
        ndim: the required number of dimensions.

    Returns:
        loads: an array of the input's shape, dtype float64 (always a fresh copy).
    """
    array = to_numpy(name, value)
    if array.dtype == np.bool_ or not (np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)):
        raise TypeError(f"{name}: expected a real (integer or floating) dtype, got {describe(value)}")
    if array.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got {describe(value)}")
    loads = np.array(array, dtype=np.float64)
    if not np.all(np.isfinite(loads)):
        raise ValueError(f"{name}: expected finite values, got NaN or infinity")
    if loads.size and loads.min() < 0:
        raise ValueError(f"{name}: expected non-negative loads, got a minimum of {loads.min()!r}")
    return loads


def as_indices(name: str, value, ndim: int, upper: Optional[int] = None, allow_negative_one: bool = False) -> np.ndarray:
    """Convert integer indices to an int64 numpy array and check their range.

    Arguments:
        name: the argument's name, for error messages.
        value: torch tensor or numpy array of an integer dtype.
        ndim: the required number of dimensions.
        upper: exclusive upper bound of the valid values, or None for no bound.
        allow_negative_one: accept -1 as a "no entry" marker.

    Returns:
        indices: an array of the input's shape, dtype int64 (always a fresh copy).
    """
    array = to_numpy(name, value)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer dtype, got {describe(value)}")
    if array.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got {describe(value)}")
    indices = np.array(array, dtype=np.int64)
    if indices.size:
        lowest = -1 if allow_negative_one else 0
        if indices.min() < lowest:
            raise ValueError(f"{name}: expected values >= {lowest}, got a minimum of {int(indices.min())}")
        if upper is not None and indices.max() >= upper:
            raise ValueError(f"{name}: expected values < {upper}, got a maximum of {int(indices.max())}")
    return indices


def as_float(name: str, value, minimum: float = 0.0, maximum: Optional[float] = None) -> float:
    """Check that a value is a finite real number in `[minimum, maximum]`.

    Arguments:
        name: the argument's name, for error messages.
        value: the value to check.
        minimum: the smallest accepted value.
        maximum: the largest accepted value, or None for no bound.

    Returns:
        value: the value as a Python float.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {describe(value)}")
    result = float(value)
    if not np.isfinite(result) or result < minimum or (maximum is not None and result > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name}: expected a finite number {bound}, got {result!r}")
    return result


def inplace_array(name: str, value, dtype, shape) -> np.ndarray:
    """Check an array that native code will read or modify in place (no conversion, no copy).

    Arguments:
        name: argument name for the error message.
        value: the array.
        dtype: the numpy dtype it must have.
        shape: the shape it must have (a tuple; `None` entries match any length).

    Returns:
        value: the same array.

    Raises:
        ValueError: not a C-contiguous numpy array of that dtype and shape.
    """
    ok = isinstance(value, np.ndarray) and value.dtype == dtype and value.flags.c_contiguous and value.ndim == len(shape)
    ok = ok and all(want is None or got == want for got, want in zip(value.shape, shape))
    if not ok:
        got = f"{value.dtype} {list(value.shape)}" if isinstance(value, np.ndarray) else describe(value)
        wanted = ", ".join("*" if n is None else str(n) for n in shape)
        raise ValueError(f"{name}: expected a C-contiguous {np.dtype(dtype)} array of shape [{wanted}], got {got}")
    return value


MAX_NATIVE_THREADS = 4  # threads the compiled EPLB code (search, refinement) uses at most


def native_threads(threads=None) -> int:
    """Threads for the compiled EPLB code: `threads`, or the CPUs this process may use, at most
    `MAX_NATIVE_THREADS` (layers are independent: the result does not depend on the count).

    Arguments:
        threads: an int >= 1, or None for the default.

    Returns:
        threads: int >= 1.
    """
    if threads is None:
        return min(len(os.sched_getaffinity(0)), MAX_NATIVE_THREADS)
    return max(1, int(threads))
