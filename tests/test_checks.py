"""The shared checkers (mooncake_ep_switch/checks.py): integers and flags, what they accept, and their one
message style."""
import numpy as np
import pytest
import torch

from mooncake_ep_switch.checks import check_flag, check_int


@pytest.mark.parametrize("value, minimum, expected", [
    (0, None, 0),
    (-7, None, -7),
    (5, 5, 5),
    (np.int64(9), 1, 9),
    (np.uint8(3), 0, 3),
    (torch.tensor(4), 1, 4),
    (2**63 - 1, 1, 2**63 - 1),
])
def test_accepts_integers(value, minimum, expected):
    result = check_int("n", value, minimum)
    assert result == expected and type(result) is int


def test_the_upper_bound_is_the_native_range_unless_lifted():
    assert check_int("n", 2**70, 1, maximum=None) == 2**70
    assert check_int("n", 2**31 - 1, 1, maximum=2**31 - 1) == 2**31 - 1


@pytest.mark.parametrize("value, minimum, error, message", [
    (0, 1, ValueError, "n: expected an int >= 1, got 0"),
    (np.int32(-3), 0, ValueError, "n: expected an int >= 0, got -3"),
    (True, 0, TypeError, "n: expected an int >= 0, got bool True"),
    (2.0, None, TypeError, "n: expected an int, got float 2.0"),
    ("3", 1, TypeError, "n: expected an int >= 1, got str '3'"),
    (None, 1, TypeError, "n: expected an int >= 1, got NoneType None"),
    (np.float64(1.0), 1, TypeError, f"n: expected an int >= 1, got float64 {np.float64(1.0)!r}"),
    (torch.tensor([1, 2]), 1, TypeError, "n: expected an int >= 1, got Tensor tensor([1, 2])"),
    (2**63, 1, ValueError, "n: expected an int in [1, 9223372036854775807], got 9223372036854775808"),
    (2**63, None, ValueError, "n: expected an int <= 9223372036854775807, got 9223372036854775808"),
])
def test_rejects_with_one_message_style(value, minimum, error, message):
    with pytest.raises(error) as caught:
        check_int("n", value, minimum)
    assert str(caught.value) == message


def test_long_values_are_shortened():
    with pytest.raises(TypeError) as caught:
        check_int("n", "x" * 200, 1)
    text = str(caught.value)
    assert text.startswith("n: expected an int >= 1, got str 'xxx") and text.endswith("...") and len(text) < 120


@pytest.mark.parametrize("value, expected", [
    (True, True), (False, False), (1, True), (0, False), (np.bool_(True), True), (np.bool_(False), False),
    (np.int64(1), True), (np.uint8(0), False), (np.int32(1), True),
])
def test_flags_as_the_peers_bindings_take_them(value, expected):
    """issue 42 item 1: DeepEP's and Mooncake's callers pass 0/1 and NumPy bools where a bool is declared."""
    result = check_flag("f", value)
    assert result is expected


@pytest.mark.parametrize("value, error, message", [
    (2, ValueError, "f: expected a bool (or 0/1), got 2"),
    (-1, ValueError, "f: expected a bool (or 0/1), got -1"),
    (np.int64(2), ValueError, "f: expected a bool (or 0/1), got 2"),
    ("yes", TypeError, "f: expected a bool (or 0/1), got str 'yes'"),
    (1.0, TypeError, "f: expected a bool (or 0/1), got float 1.0"),
    (np.float32(1.0), TypeError, f"f: expected a bool (or 0/1), got float32 {np.float32(1.0)!r}"),
    (None, TypeError, "f: expected a bool (or 0/1), got NoneType None"),
    (torch.tensor(True), TypeError, "f: expected a bool (or 0/1), got Tensor tensor(True)"),
])
def test_anything_else_is_refused_by_name(value, error, message):
    with pytest.raises(error) as caught:
        check_flag("f", value)
    assert str(caught.value) == message


def test_none_only_where_it_means_a_default():
    assert check_flag("f", None, allow_none=True) is None
    assert check_flag("f", np.bool_(True), allow_none=True) is True
    with pytest.raises(ValueError, match=r"^f: expected None, a bool \(or 0/1\), got 2$"):
        check_flag("f", 2, allow_none=True)
