"""Placement (connector/placement.py) against a token-by-token reference: each staged key moved
alone, then mapped alone, in float32, rounded once; rows that neither move nor are mapped come
out bit for bit as stored, and the staged tensors are only read.

Mapped keys are compared to half a bf16 step of the float32 reference: the worker maps them with
the engine's fused rotary kernel, whose multiply-adds may round differently from the torch ops,
so a value near a bf16 rounding boundary may land on either side of it."""

import pytest
import torch

from kvmem.connector.placement import DeviceKVMap, Placement, _runs
from kvmem.connector.rope import KeyRotator, LayerRotators
from kvmem.connector.staging import HostStaging
from kvmem.reader.kvmap import pair_swap
from tests.reader.test_kvmap import random_map

pytestmark = pytest.mark.cpu_backend

LAYERS, HEADS, DIM = 4, 2, 64


def rotator(theta: float) -> KeyRotator:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(DIM, max_position=4096, rope_parameters={"rope_theta": theta, "rope_type": "default"},
                        dtype=torch.bfloat16)
    return KeyRotator(rope)


@pytest.fixture(scope="module")
def rotators():
    """Two rotary bases over the layers, as Gemma 3's local and global layers have."""
    local, glob = rotator(10000.0), rotator(1000000.0)
    return LayerRotators([local, glob, local, glob])


@pytest.mark.parametrize("rows, runs", [
    ([0, 0, 1, 1, 0, 1], [(2, 4), (5, 6)]),
    ([1, 1, 1], [(0, 3)]),
    ([0, 0], []),
    ([1, 0, 0, 1], [(0, 1), (3, 4)]),
])
def test_runs_are_the_consecutive_true_rows(rows, runs):
    assert _runs(torch.tensor(rows, dtype=torch.bool)) == tuple(slice(a, b) for a, b in runs)


def staged_step():
    """Two jobs, as a step stages them: each a head that stays put and is not mapped, then facts
    encoded elsewhere (one pre-RoPE, src -1); the second job reads without the map."""
    g = torch.Generator().manual_seed(0)
    n = 30
    key = torch.randn(n, HEADS, DIM, generator=g).to(torch.bfloat16)
    value = torch.randn(n, HEADS, DIM, generator=g).to(torch.bfloat16)
    dst = torch.cat([torch.arange(0, 15), torch.arange(0, 15)])
    src = dst.clone()
    src[5:15] = torch.arange(300, 310)  # job 1's facts moved
    src[9] = -1  # a format-1 (pre-RoPE) key among them
    src[20:30] = torch.arange(40, 50)  # job 2's facts moved
    mapped = torch.zeros(n, dtype=torch.bool)
    mapped[5:15] = True
    return key, value, src, dst, mapped


def assert_rounded(got: torch.Tensor, want: torch.Tensor) -> None:
    """got (bf16) is float32 `want` rounded to bf16, give or take float32 noise at a boundary."""
    assert torch.all((got.float() - want).abs() <= want.abs() * 2**-8 * (1 + 1e-4) + 1e-30)


def reference(i, key, value, src, dst, mapped, rotators, kv_map):
    """Layer i, one token at a time: keys in float32, values rounded to bf16."""
    a, b = (t[i] for t in kv_map.key_factors())
    keys, values = [], []
    for t in range(len(key)):
        k, v = key[t : t + 1].float().contiguous(), value[t : t + 1]
        if src[t] != dst[t]:
            rotators.per_layer[i].move(k[None], src[t : t + 1], dst[t : t + 1])
        if mapped[t]:
            k = a * k + b * pair_swap(k)
            v = v.float() * kv_map.value_scale[i] + kv_map.value_shift[i]
        keys.append(k)
        values.append(v.to(torch.bfloat16))
    return torch.cat(keys), torch.cat(values)


def test_each_layer_matches_the_token_by_token_reference(rotators):
    key, value, src, dst, mapped = staged_step()
    kv_map = random_map(LAYERS, HEADS, DIM)
    place = Placement.of(src, dst, mapped, rotators, DeviceKVMap.on(kv_map, torch.device("cpu")), torch.device("cpu"))
    assert [r for r, _ in place.moves] == [slice(5, 15), slice(20, 30)] and place.mapped == (slice(5, 15),)
    before = key.clone(), value.clone()
    for i in range(LAYERS):
        got_k, got_v = place.layer(i, key, value, torch.bfloat16)
        want_k, want_v = reference(i, key, value, src, dst, mapped, rotators, kv_map)
        assert torch.equal(got_k[~mapped], want_k[~mapped].to(torch.bfloat16))  # moved only: bit for bit
        assert_rounded(got_k[mapped], want_k[mapped])
        assert torch.equal(got_v, want_v)
        assert torch.equal(got_k[:5], key[:5]) and torch.equal(got_v[15:], value[15:])  # untouched rows
    assert torch.equal(key, before[0]) and torch.equal(value, before[1])  # the staging buffer is only read


@pytest.mark.parametrize("work", [None, "kept"])
@pytest.mark.parametrize("step", ["heads stay, two rotary bases, mapped", "every row moves, one rotary base",
                                  "nothing moves"])
def test_all_layers_at_once_is_each_layer_bit_for_bit(rotators, step, work):
    """The CPU path (one op per pass over every layer) against `layer`, layer by layer; with
    work buffers kept across steps (the worker's), after a larger step left them dirty."""
    key, value, src, dst, mapped = staged_step()
    kv_map = DeviceKVMap.on(random_map(LAYERS, HEADS, DIM), torch.device("cpu"))
    if step == "every row moves, one rotary base":
        rotators, src, mapped, kv_map = LayerRotators.uniform(rotators.per_layer[0], LAYERS), dst + 100, None, None
    if step == "nothing moves":
        src, mapped, kv_map = dst, None, None
    keys = torch.stack([key * (i + 1) for i in range(LAYERS)])  # [L, N, H, D]: each layer its own
    values = torch.stack([value - i for i in range(LAYERS)])
    place = Placement.of(src, dst, mapped, rotators, kv_map, torch.device("cpu"))
    before = keys.clone(), values.clone()
    buffers = None
    if work == "kept":
        buffers = HostStaging(pin=False)
        wider = torch.cat([keys, keys], dim=1)  # a larger step before, through the same buffers
        Placement.of(torch.cat([src, src]), torch.cat([dst, dst]), None, rotators, None,
                     torch.device("cpu")).all_layers(wider, torch.cat([values, values], dim=1), torch.bfloat16, buffers)
    got_k, got_v = place.all_layers(keys, values, torch.bfloat16, buffers)
    for i in range(LAYERS):
        want_k, want_v = place.layer(i, keys[i], values[i], torch.bfloat16)
        assert torch.equal(got_k[i], want_k) and torch.equal(got_v[i], want_v), (step, i)
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])  # the staging buffer is only read


def test_a_step_where_nothing_moves_or_is_mapped_is_a_cast(rotators):
    key, value, _, dst, mapped = staged_step()
    for kv_map in (None, DeviceKVMap.on(random_map(LAYERS, HEADS, DIM), torch.device("cpu"))):
        place = Placement.of(dst, dst, None if kv_map else mapped, rotators, kv_map, torch.device("cpu"))
        assert place.moves == () and place.mapped == ()
        got_k, got_v = place.layer(0, key, value, torch.bfloat16)
        assert torch.equal(got_k, key) and torch.equal(got_v, value)


@pytest.mark.parametrize("rotary_dim", [None, DIM // 2])
def test_the_key_map_through_the_rotary_kernel_is_the_torch_formula(rotary_dim):
    """The kernel path against the lab's formula (and the torch path the worker takes without
    the kernel), full and partial rotary, to float32 rounding."""
    from kvmem.reader.kvmap import pair_swap

    kv_map = random_map(LAYERS, HEADS, DIM, rotary_dim=rotary_dim)
    k = torch.randn(50, HEADS, DIM, generator=torch.Generator().manual_seed(3))
    fast, slow = DeviceKVMap.on(kv_map, torch.device("cpu")), None
    assert fast.kernel is not None
    slow = DeviceKVMap(*(getattr(fast, f) for f in ("rows", "a", "b", "scale", "shift", "rotary_dim")), None)
    for layer in range(LAYERS):
        a, b = (t[layer] for t in kv_map.key_factors())
        want = a * k + b * pair_swap(k, rotary_dim)
        for path in (fast, slow):
            got = k.clone()
            path.keys_(got, layer)
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(want, k, atol=1e-2)  # the map does something
    for path in (fast, slow):  # every layer in one call
        every = k[None].repeat(LAYERS, 1, 1, 1)
        path.keys_(every)
        for layer in range(LAYERS):
            a, b = (t[layer] for t in kv_map.key_factors())
            assert torch.allclose(every[layer], a * k + b * pair_swap(k, rotary_dim), rtol=1e-6, atol=1e-6)
