"""The real CPU attention backend's cache-write op, outside the engine, for layout tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def cpu_attention_layer(model_path: str, block_size: int, head_size: int, dtype=torch.bfloat16):
    """An object shaped like vLLM's attention layer (`.impl.do_kv_cache_update`), backed by the
    real CPUAttentionBackendImpl, for 3 KV heads."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

    config = VllmConfig(model_config=ModelConfig(model=model_path, dtype=dtype))
    with set_current_vllm_config(config):
        impl = CPUAttentionBackendImpl(
            num_heads=9, head_size=head_size, scale=head_size**-0.5, num_kv_heads=3,
            alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
        )
    return SimpleNamespace(impl=impl, isa=_get_attn_isa(dtype, block_size, head_size), _k_scale_float=1.0,
                           _v_scale_float=1.0)


def cpu_cache_writer(model_path: str, block_size: int, head_size: int, dtype=torch.bfloat16):
    """write(key [T,H,D], value [T,H,D], cache, slots) through CPUAttentionBackendImpl."""
    layer = cpu_attention_layer(model_path, block_size, head_size, dtype)

    def write(key, value, cache, slots):
        layer.impl.do_kv_cache_update(layer, key, value, cache, slots)

    return write, layer.isa
