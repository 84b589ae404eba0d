"""Each codec's round trip stays within the error it states, and slicing by token commutes with it."""

import pytest
import torch

from kvmem.errors import InvalidInputError
from kvmem.kv.codec import (CODECS, TENSOR_CODECS, blob_codec, bytes_per_token, check_codec, encode, hadamard,
                            role_codecs)


def kv_like(seed=0, shape=(3, 17, 2, 64)):
    """bf16 [L, T, H, D] with outlier channels, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 5] *= 20  # an outlier channel
    return x.to(torch.bfloat16)


# Largest error relative to the (layer, token, head) row's absolute maximum.
BOUNDS = {"fp8": 2**-4, "int8": 0.5 / 127 + 2**-9, "int4": 0.5 / 15 * 2 + 2**-9}


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_round_trip_within_the_stated_error(codec):
    x = kv_like()
    coded = encode(x, codec)
    back = coded.decode()
    assert back.shape == x.shape and back.dtype == torch.float32
    row_max = x.float().abs().amax(-1, keepdim=True)
    err = ((back - x.float()).abs() / row_max).max().item()
    assert err <= BOUNDS[codec], f"{codec}: {err}"
    assert err > 0  # lossy codecs really are lossy: the bound is not vacuous
    assert coded.decode(torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("codec, levels", [("int7", 127), ("int6", 63), ("int4h", 15)])
def test_rotated_codecs_are_within_half_a_level_in_the_rotated_frame(codec, levels):
    x = kv_like()
    back = encode(x, codec).decode()
    h = hadamard(64)
    y, y_back = x.float() @ h, back @ h  # H is its own inverse: y_back is what was quantized
    level = (y.amax(-1, keepdim=True) - y.amin(-1, keepdim=True)) / levels
    slack = 2**-9 * y.abs().amax(-1, keepdim=True)  # float16 scale and minimum
    assert ((y_back - y).abs() <= 0.55 * level + slack).all()
    assert not torch.equal(back, x.float())


def rms_error(x, codec):
    return ((encode(x, codec).decode() - x.float()).pow(2).mean() / x.float().pow(2).mean()).sqrt().item()


def test_rotation_pays_on_an_outlier_channel():
    x = kv_like(3)
    assert rms_error(x, "int4h") < 0.5 * rms_error(x, "int4")
    assert rms_error(x, "int6") < rms_error(x, "int8")  # 6 rotated bits beat 8 plain ones here
    assert rms_error(x, "int7") < 0.6 * rms_error(x, "int6")


@pytest.mark.parametrize("bits", [6, 7])
def test_packing_round_trips_every_level(bits):
    from kvmem.kv.codec import _pack, _unpack

    q = torch.arange(2**bits, dtype=torch.uint8).repeat(4).reshape(1, 2, 2, 2**bits)  # every level, four times
    packed = _pack(q, bits)
    assert packed.shape[-1] == 2**bits * bits // 8 and torch.equal(_unpack(packed, bits).to(torch.uint8), q)


@pytest.mark.parametrize("size", [64, 128, 80, 96])
def test_hadamard_is_orthonormal_and_its_own_inverse(size):
    h = hadamard(size)
    assert torch.allclose(h @ h, torch.eye(size), atol=1e-5) and torch.equal(h, h.T)
    x = kv_like(4, (1, 3, 2, size))
    assert encode(x, "int6").decode().shape == x.shape  # head sizes that are not a power of two


def test_none_is_the_tensor_itself():
    x = kv_like()
    coded = encode(x, "none")
    assert coded.decode() is coded.parts["data"] and torch.equal(coded.decode(), x)


@pytest.mark.parametrize("codec", TENSOR_CODECS)
def test_token_slices_decode_to_the_same_values(codec):
    x = kv_like(1)
    coded = encode(x, codec)
    assert torch.equal(coded.tokens(4, 9).decode(), coded.decode()[:, 4:9])
    assert coded.tokens(4, 9).shape == (3, 5, 2, 64)


@pytest.mark.parametrize("codec", CODECS)
def test_bytes_per_token_is_what_a_coded_tensor_holds(codec):
    x = kv_like(2)
    keys, values = role_codecs(codec)
    per_token = (encode(x, keys).nbytes + encode(x, values).nbytes) // x.shape[1]
    assert per_token == bytes_per_token(codec, 3, 2, 64, itemsize=2)


def test_sizes_against_the_cache():
    bf16 = bytes_per_token("none", 30, 3, 64, 2)
    assert bf16 == 23_040  # SmolLM2-135M's own cache per token
    assert bf16 / bytes_per_token("int4", 30, 3, 64, 2) > 3.5
    assert bf16 / bytes_per_token("int8", 30, 3, 64, 2) > 1.9
    assert bf16 / bytes_per_token("k8v4", 30, 3, 64, 2) > 2.5 and bytes_per_token("k4v8", 30, 3, 64, 2) == 9_180
    assert bf16 / bytes_per_token("int6", 30, 3, 64, 2) > 2.4 and bytes_per_token("int4h", 30, 3, 64, 2) == 6_480
    assert bf16 / bytes_per_token("k7v8", 30, 3, 64, 2) >= 2.0  # the "2x smaller again"


def test_k8v4_keeps_8_bit_keys_and_4_bit_values():
    assert role_codecs("k8v4") == ("int8", "int4") and blob_codec("int8", "int4") == "k8v4"
    assert role_codecs("k4v8") == ("int4", "int8") and blob_codec("int4", "int8") == "k4v8"
    assert role_codecs("k7v8") == ("int7", "int8") and blob_codec("int7", "int8") == "k7v8"
    assert role_codecs("int4") == ("int4", "int4") and blob_codec("fp8", "fp8") == "fp8"
    with pytest.raises(ValueError, match="no blob codec"):
        blob_codec("int4", "fp8")
    with pytest.raises(ValueError, match="role_codecs"):
        encode(kv_like(), "k8v4")


def test_zero_rows_survive():
    x = torch.zeros(1, 2, 1, 8, dtype=torch.bfloat16)
    for codec in TENSOR_CODECS:
        assert torch.equal(encode(x, codec).decode(torch.bfloat16), x)


def test_unknown_codec_is_refused():
    with pytest.raises(InvalidInputError, match="unknown KV codec") as err:
        check_codec("zip")
    assert err.value.param == "codec"
