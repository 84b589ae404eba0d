"""int8 rows with a per-row scale: the round trip stays within the stated bound."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.errors import InvalidInputError
from kvmem.index.rowquant import decode, dtype_for, quantize


def test_round_trip_error_is_within_half_a_step_and_dots_within_the_bound():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((500, 384)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    stored, scales = quantize(rows, np.int8)
    assert stored.dtype == np.int8 and scales.shape == (500,)
    back = decode(stored, scales)  # [500, 384]
    assert np.all(np.abs(back - rows) <= scales[:, None] / 2 + 1e-7)
    q = rows[0]
    bound = scales / 2 * np.abs(q).sum()  # [500] (s/2) |q|_1
    assert np.all(np.abs(back @ q - rows @ q) <= bound + 1e-6)
    assert np.abs(back @ q - rows @ q).mean() < 1e-3


def test_float_rows_are_kept_exactly_and_zero_rows_survive():
    rows = np.vstack([np.zeros(8, np.float32), np.arange(8, dtype=np.float32)])
    stored, scales = quantize(rows, np.float32)
    assert np.array_equal(decode(stored, scales), rows)
    stored, scales = quantize(rows, np.int8)
    assert np.array_equal(decode(stored, scales)[0], np.zeros(8)) and np.isfinite(scales).all()
    assert np.abs(decode(stored, scales)[1] - rows[1]).max() <= scales[1] / 2


def test_only_8_or_32_bits():
    with pytest.raises(InvalidInputError):
        dtype_for(16)
