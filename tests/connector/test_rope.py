"""KeyRotator against vLLM's own rotary embedding."""

import pytest
import torch

from kvmem.connector.rope import KeyRotator

pytestmark = pytest.mark.cpu_backend  # the rotary kernel on host tensors (tests/gpu/ has the CUDA twin)


@pytest.fixture(scope="module")
def rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(64, max_position=8192, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
                        dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def llama3_rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    with set_current_vllm_config(VllmConfig()):
        return get_rope(64, max_position=16384, rope_parameters=params, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def partial_gptj_rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}
    with set_current_vllm_config(VllmConfig()):
        return get_rope(64, max_position=4096, rope_parameters=params, dtype=torch.bfloat16, is_neox_style=False)


@pytest.mark.parametrize("which", ["rope", "llama3_rope", "partial_gptj_rope"])
def test_fused_kernel_matches_vllm_reference_rotation(which, request):
    rope = request.getfixturevalue(which)
    fast, reference = KeyRotator(rope), KeyRotator(rope, use_kernel=False)
    assert fast._kernel is not None, "vLLM's rotary kernel is missing from this build"
    key = torch.randn(3, 50, 2, 64)  # [L, T, H, D]
    pos = torch.randint(0, 4000, (50,))
    before = key.clone()
    for a, b in [(fast.rotate(key, pos), reference.rotate(key, pos)),
                 (fast.unrotate(key, pos), reference.unrotate(key, pos))]:
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert torch.equal(key, before), "rotate() must not touch its input"
    inplace = key.clone()
    assert fast.rotate(inplace, pos, inplace=True).data_ptr() == inplace.data_ptr()
    assert torch.allclose(inplace, reference.rotate(key, pos), atol=1e-5)
    with pytest.raises(ValueError, match="in-place"):
        fast.rotate(key.to(torch.bfloat16), pos, inplace=True)


@pytest.mark.parametrize("which", ["rope", "llama3_rope", "partial_gptj_rope"])
def test_unrotate_then_rotate_is_identity(which, request):
    rot = KeyRotator(request.getfixturevalue(which))
    key = torch.randn(2, 40, 3, 64).to(torch.bfloat16)  # [L, T, H, D] as cached
    pos = torch.arange(1000, 1040)
    back = rot.rotate(rot.unrotate(key, pos), pos).to(torch.bfloat16)
    assert torch.equal(back, key) or torch.allclose(back.float(), key.float(), rtol=2**-7, atol=1e-6)
    assert (back == key).float().mean() > 0.99


def test_rotate_matches_vllm_rotation_at_any_position(rope):
    rot = KeyRotator(rope)
    pre = torch.randn(1, 16, 3, 64).to(torch.bfloat16)
    pos = torch.randint(0, 8000, (16,))
    ours = rot.rotate(pre, pos).to(torch.bfloat16)[0]  # [T, H, D]
    query = torch.zeros(16, 3 * 64, dtype=torch.bfloat16)
    _, theirs = rope.forward_native(pos, query, pre[0].reshape(16, -1).clone())
    assert torch.allclose(ours.float(), theirs.view(16, 3, 64).float(), rtol=2**-7, atol=2e-2)


def test_moving_a_key_is_rotating_by_the_difference(rope):
    """Chunked RoPE's premise: R(q) R(p)^-1 k_p == k rotated to q."""
    rot = KeyRotator(rope)
    pre = torch.randn(1, 8, 3, 64)
    at_p = rot.rotate(pre, torch.arange(10, 18))
    moved = rot.rotate(rot.unrotate(at_p, torch.arange(10, 18)), torch.arange(500, 508))
    assert torch.allclose(moved, rot.rotate(pre, torch.arange(500, 508)), atol=1e-2)


@pytest.mark.parametrize("which", ["rope", "llama3_rope", "partial_gptj_rope"])
def test_move_is_unrotate_then_rotate_in_one_call(which, request):
    """move() composes R(q) R(p)^-1 per token and rotates once: the same keys as the two-step
    route, forwards and backwards, and a pre-RoPE key (src -1) is simply rotated."""
    rot = KeyRotator(request.getfixturevalue(which))
    pre = torch.randn(2, 6, 3, 64)
    src = torch.tensor([10, 11, 300, 301, 5, -1])
    dst = torch.tensor([500, 11, 20, 21, 5, 7])  # forwards, staying, backwards, and a pre-RoPE key
    cached = rot.rotate(pre, src.clamp_min(0))
    cached[:, 5] = pre[:, 5]
    moved = rot.move(cached.clone(), src, dst)
    two_step = cached.clone()
    two_step[:, :5] = rot.unrotate(cached[:, :5], src[:5])
    assert torch.allclose(moved, rot.rotate(two_step, dst), atol=1e-5)
    assert torch.allclose(moved, rot.rotate(pre, dst), atol=1e-4)


def test_a_scaled_table_moves_exactly(model_dir):
    """LongRoPE's table carries a scale (|c + is| != 1): the composed row divides it out once."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
        Phi3LongRoPEScaledRotaryEmbedding,
    )

    config = VllmConfig()
    config.model_config = SimpleNamespace(max_model_len=4096)
    with set_current_vllm_config(config):
        rope = Phi3LongRoPEScaledRotaryEmbedding(
            64, 32, 4096, 1024, 10000.0, True, torch.float32,
            short_factor=[1.0] * 16, long_factor=[1.5 + i for i in range(16)])
    rot = KeyRotator(rope)
    pre = torch.randn(1, 4, 2, 64)
    src, dst = torch.tensor([100, 101, -1, 7]), torch.tensor([3, 900, 50, 7])
    cached = rot.rotate(pre, src.clamp_min(0))
    cached[:, 2] = pre[:, 2]
    assert torch.allclose(rot.move(cached.clone(), src, dst), rot.rotate(pre, dst), atol=1e-4)


def test_positions_beyond_the_table_are_refused(rope):
    with pytest.raises(ValueError, match="beyond"):
        KeyRotator(rope).rotate(torch.zeros(1, 1, 3, 64), torch.tensor([9000]))


def test_layer_rotators_apply_each_layers_own_embedding(rope, llama3_rope):
    """Gemma 3's shape: local and global layers with different rotary bases, interleaved."""
    from kvmem.connector.rope import LayerRotators

    local, global_ = KeyRotator(rope), KeyRotator(llama3_rope)
    layers = LayerRotators([local, global_, local])
    key = torch.randn(3, 40, 2, 64)  # [L, T, H, D]
    pos = torch.randint(0, 4000, (40,))
    rotated = layers.rotate(key, pos)
    for i, rot in enumerate([local, global_, local]):
        assert torch.equal(rotated[i : i + 1], rot.rotate(key[i : i + 1], pos))
    assert not torch.allclose(rotated[1], local.rotate(key[1:2], pos)[0], atol=1e-3)  # the bases do differ
    assert torch.allclose(layers.unrotate(rotated, pos), key, atol=1e-4)
    one = key[1:2].clone()
    layers.rotate_layer(1, one, pos)
    assert torch.equal(one, rotated[1:2])
    inplace = key.clone()
    assert torch.equal(layers.rotate(inplace, pos, inplace=True), rotated) and torch.equal(inplace, rotated)
    with pytest.raises(ValueError, match="3 rotators"):
        layers.rotate(key[:2], pos)
    with pytest.raises(ValueError, match="beyond the rotary table"):
        layers.check_positions(torch.tensor([min(local.max_position, global_.max_position)]))


@pytest.mark.parametrize("max_model_len", [4096, 1024])
def test_longrope_rotation_matches_the_engines(model_dir, max_model_len):
    """Phi-3's LongRoPE keeps a short and a long table and uses one for every position (long
    when max_model_len exceeds the original context): the rotator must read that one."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
        Phi3LongRoPEScaledRotaryEmbedding,
    )

    from kvmem.connector.rope import is_rotary

    config = VllmConfig()
    config.model_config = SimpleNamespace(max_model_len=max_model_len)  # all LongRoPE reads of it
    with set_current_vllm_config(config):  # built directly: get_rope's cache ignores max_model_len
        rope = Phi3LongRoPEScaledRotaryEmbedding(
            64, 32, 4096, 1024, 10000.0, True, torch.float32,
            short_factor=[1.0 + i / 16 for i in range(16)], long_factor=[1.5 + i for i in range(16)])
    assert is_rotary(rope) and rope.use_long_rope == (max_model_len > 1024)
    key = torch.randn(1, 30, 2, 64)  # [L, T, H, D]
    pos = torch.randint(0, 1000, (30,))
    _, engine_k = rope.forward(pos, key[0].reshape(30, 128).clone(), key[0].reshape(30, 128).clone())
    ours = KeyRotator(rope).rotate(key, pos)
    assert torch.allclose(ours[0].reshape(30, 128), engine_k, atol=1e-5)
