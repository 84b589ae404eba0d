"""Start-up refusals: each unsupported vLLM configuration is named, built from vLLM's own config
classes (no engine needed), and the connector refuses it before serving anything."""

import json

import pytest
import torch

from kvmem.connector.support import refuse_unsupported, unsupported
from kvmem.errors import UnsupportedConfigError


@pytest.fixture(scope="module")
def model_config(model_dir):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(model_dir), dtype=torch.bfloat16)


def kv_cache_config(*specs):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def full_attention(**kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, **kw)


def sliding_window():
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=512)


def reasons(model_config, parallel=None, cache=None, kv=None):
    from vllm.config import CacheConfig, ParallelConfig

    return unsupported(parallel or ParallelConfig(), model_config, cache or CacheConfig(), kv)


def test_the_bundled_setup_is_supported(model_config):
    assert reasons(model_config, kv=kv_cache_config(full_attention())) == []


def test_tensor_parallel_is_refused(model_config):
    from vllm.config import ParallelConfig

    assert reasons(model_config, parallel=ParallelConfig(tensor_parallel_size=2)) == [
        "tensor parallel size 2 (kvmem supports 1)"]


def test_pipeline_parallel_is_refused(model_config):
    from vllm.config import ParallelConfig

    assert reasons(model_config, parallel=ParallelConfig(pipeline_parallel_size=2)) == [
        "pipeline parallel size 2 (kvmem supports 1)"]


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache_is_refused(model_config, dtype):
    from vllm.config import CacheConfig

    (reason,) = reasons(model_config, cache=CacheConfig(cache_dtype=dtype))
    assert reason.startswith(f"KV cache dtype '{dtype}'")


def test_mla_is_refused(tmp_path, model_dir):
    """A DeepSeek-V2-shaped config (MLA attention), loaded by vLLM's ModelConfig."""
    from vllm.config import ModelConfig

    config = {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
        "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 64, "q_lora_rank": None,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "vocab_size": 49152,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    mla = ModelConfig(model=str(tmp_path), tokenizer=str(model_dir), dtype=torch.bfloat16)
    assert mla.use_mla
    assert reasons(mla) == ["MLA attention (a compressed latent cache, not per-head K/V)"]


def test_hybrid_cache_groups_are_refused(model_config):
    (reason,) = reasons(model_config, kv=kv_cache_config(full_attention(), sliding_window()))
    assert reason.startswith("hybrid KV cache with 2 groups (FullAttentionSpec, SlidingWindowSpec)")


def test_sliding_window_layers_beside_full_attention_are_served(model_config):
    """With the hybrid allocator off, vLLM folds sliding-window layers into full attention and
    keeps every block: the window is applied by the attention kernel, for injected KV as for text."""
    assert reasons(model_config, kv=kv_cache_config(full_attention(sliding_window=512))) == []


def test_sliding_window_in_every_layer_is_refused(model_config):
    """Mistral v0.1's shape: one sliding-window group, whose allocator frees out-of-window blocks."""
    (reason,) = reasons(model_config, kv=kv_cache_config(sliding_window()))
    assert reason.startswith("sliding-window attention in every layer (window 512)")


def test_chunked_local_attention_is_refused(model_config):
    (reason,) = reasons(model_config, kv=kv_cache_config(full_attention(attention_chunk_size=64)))
    assert reason.startswith("chunked-local attention")


def test_recurrent_state_is_refused(model_config):
    """Linear-attention / Mamba layers keep a state per request, not K/V per token."""
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(block_size=16, shapes=((4, 64),), dtypes=(torch.bfloat16,))
    (reason,) = reasons(model_config, kv=kv_cache_config(mamba))
    assert reason.startswith("MambaSpec KV cache")
    (reason,) = reasons(model_config, kv=kv_cache_config(full_attention(), mamba))
    assert reason.startswith("hybrid KV cache with 2 groups (FullAttentionSpec, MambaSpec)")


def test_cross_layer_kv_sharing_is_refused(model_config):
    """Layers built by vLLM itself, the second reading the first's KV (Gemma 3n's shape)."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from kvmem.connector.support import layer_reasons

    config = VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=32))
    with set_current_vllm_config(config):
        own = Attention(4, 64, 0.125, num_kv_heads=2, cache_config=config.cache_config, prefix="model.layers.0.attn")
        shared = Attention(4, 64, 0.125, num_kv_heads=2, cache_config=config.cache_config,
                           prefix="model.layers.1.attn", kv_sharing_target_layer_name="model.layers.0.attn")
    assert layer_reasons({"model.layers.0.attn": own}) == []
    (reason,) = layer_reasons({"model.layers.0.attn": own, "model.layers.1.attn": shared})
    assert reason.startswith("cross-layer KV sharing (1 layers reuse another layer's KV, e.g. model.layers.1.attn)")


def test_the_refusal_names_every_reason(model_config):
    from types import SimpleNamespace

    from vllm.config import CacheConfig, CompilationConfig, ParallelConfig

    config = SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=2), model_config=model_config,
                             cache_config=CacheConfig(cache_dtype="fp8"), compilation_config=CompilationConfig())
    with pytest.raises(UnsupportedConfigError, match="tensor parallel size 2.*KV cache dtype 'fp8'"):
        refuse_unsupported(config, None)


def test_the_connector_refuses_at_construction(model_config, tmp_path):
    """The class vLLM loads checks before building either side."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvmem.connector.connector import KvmemConnector

    transfer = KVTransferConfig(kv_connector="KvmemConnector", kv_connector_module_path="kvmem.connector.connector",
                                kv_role="kv_both", kv_connector_extra_config={"kv_dir": str(tmp_path),
                                                                              "fingerprint": "f" * 64})
    config = VllmConfig(model_config=model_config, kv_transfer_config=transfer, cache_config=CacheConfig(block_size=32))
    KvmemConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(full_attention()))  # supported: builds
    with pytest.raises(UnsupportedConfigError, match="hybrid KV cache"):
        KvmemConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(full_attention(), sliding_window()))


def test_the_scheduler_side_maps_only_when_the_worker_took_the_map(model_config, tmp_path):
    """A replica's gateway sends map_from with every KV chat; where the worker dropped a map that
    does not fit the model, the scheduler side (built after it) must not report the chat mapped."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvmem.connector.connector import KvmemConnector
    from kvmem.connector.support import leave_map_refusal, map_refused
    from kvmem.reader import lora
    from tests.reader.test_kvmap import random_map

    fp, kv_dir = "e" * 64, tmp_path / "kv"
    lora.save([], tmp_path / "adapter", rank=8, alpha=16.0, base_model="", meta={"fingerprint": fp},
              kv_map=random_map(2, 3, 64))
    extra = {"kv_dir": str(kv_dir), "fingerprint": fp, "reader_adapter": str(tmp_path / "adapter")}
    transfer = KVTransferConfig(kv_connector="KvmemConnector", kv_connector_module_path="kvmem.connector.connector",
                                kv_role="kv_both", kv_connector_extra_config=extra)
    config = VllmConfig(model_config=model_config, kv_transfer_config=transfer, cache_config=CacheConfig(block_size=32))

    def scheduler_maps() -> bool:
        return KvmemConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(full_attention()))._scheduler.kv_map

    assert scheduler_maps()
    leave_map_refusal(kv_dir, fp, "the model has rotary_dim 32 of 64")
    assert map_refused(kv_dir, fp) == "the model has rotary_dim 32 of 64" and map_refused(kv_dir, "a" * 64) is None
    assert not scheduler_maps()
    leave_map_refusal(kv_dir, fp, None)  # the next start's worker took it
    assert map_refused(kv_dir, fp) is None and scheduler_maps()
