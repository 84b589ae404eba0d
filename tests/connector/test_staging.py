"""connector/staging.py: gathering a step's blob tokens into the staging buffer (`concat_tokens`)."""

from __future__ import annotations

import pytest
import torch

from kvmem.connector.staging import HostStaging, concat_tokens


def _blobs(dtype: torch.dtype, lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    """Blob parts [L, T, H, D] of `dtype`, with NaNs, infinities and negative zeros among them
    where the dtype has them: a copy must keep every bit, not only every value."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in lengths:
        x = torch.randn(3, t, 2, 8, generator=g) * 100
        if dtype.is_floating_point:
            x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
            out.append(x.to(dtype))
        else:
            out.append(x.clamp(-128, 127).to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8,
                                   torch.float8_e4m3fn, torch.float64])
def test_spans_of_blobs_land_side_by_side_bit_for_bit_as_torch_cat_puts_them(dtype):
    blobs = _blobs(dtype, [5, 1, 7, 3])
    spans = [b[:, s:e] for b, (s, e) in zip(blobs, [(1, 4), (0, 1), (2, 7), (0, 3)])]  # views, not contiguous
    n = sum(s.shape[1] for s in spans)
    staged = HostStaging(pin=False).take([((3, n, 2, 8), dtype)])[0]  # a view into the kept buffer
    staged.view(torch.uint8).fill_(7)  # what an earlier step left there
    concat_tokens(spans, staged)
    expected = torch.cat(spans, dim=1)
    assert staged.view(torch.uint8).equal(expected.view(torch.uint8))


def test_parts_of_another_dtype_are_converted_as_torch_cat_converts_them():
    """A format-1 blob keeps float32 keys beside bf16 ones: the staging dtype is float32."""
    parts = [*_blobs(torch.bfloat16, [4, 2]), *_blobs(torch.float32, [3], seed=1)]
    out = torch.empty(3, 9, 2, 8, dtype=torch.float32)
    concat_tokens(parts, out)
    assert out.view(torch.uint8).equal(torch.cat(parts, dim=1).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # numpy's path, and torch's (mixed dtypes)
def test_a_wrong_shape_is_refused_not_written_past_the_buffer(dtype):
    parts = _blobs(torch.bfloat16, [4, 2])
    for shape in ((3, 5, 2, 8), (3, 7, 2, 8), (2, 6, 2, 8), (3, 6, 2, 4)):
        with pytest.raises(ValueError, match="staging"):
            concat_tokens(parts, torch.empty(shape, dtype=dtype))
    with pytest.raises(ValueError, match="staging"):
        concat_tokens([], torch.empty(3, 0, 2, 8, dtype=dtype))
