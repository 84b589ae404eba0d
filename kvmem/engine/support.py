"""What kvmem's connector cannot serve yet, refused at engine start-up with the reason.

Each of these would otherwise fail late or silently: tensor-parallel ranks would all write the
same blob files with a slice of the heads each; pipeline stages would pair the wrong layers;
an MLA cache holds one compressed latent per token instead of per-head K/V; an fp8 (or other
quantized) cache needs scales we do not store; hybrid or sliding-window cache groups give
layers different block tables or drop old tokens.
"""

from __future__ import annotations

from kvmem.errors import UnsupportedConfigError

SUPPORTED_CACHE_DTYPES = ("auto", "float16", "bfloat16")


def unsupported(parallel_config, model_config, cache_config, kv_cache_config) -> list[str]:
    """-> one reason per unsupported feature (empty when kvmem can serve this configuration)."""
    reasons = []
    if parallel_config.tensor_parallel_size > 1:
        reasons.append(f"tensor parallel size {parallel_config.tensor_parallel_size} (kvmem supports 1)")
    if parallel_config.pipeline_parallel_size > 1:
        reasons.append(f"pipeline parallel size {parallel_config.pipeline_parallel_size} (kvmem supports 1)")
    if model_config is not None and model_config.use_mla:
        reasons.append("MLA attention (a compressed latent cache, not per-head K/V)")
    if cache_config.cache_dtype not in SUPPORTED_CACHE_DTYPES:
        reasons.append(f"KV cache dtype {cache_config.cache_dtype!r} (kvmem supports {', '.join(SUPPORTED_CACHE_DTYPES)})")
    if kv_cache_config is not None:
        reasons += _cache_group_reasons(kv_cache_config.kv_cache_groups)
    return reasons


def refuse_unsupported(vllm_config, kv_cache_config) -> None:
    """Raise UnsupportedConfigError listing every reason, or return."""
    reasons = unsupported(vllm_config.parallel_config, vllm_config.model_config, vllm_config.cache_config,
                          kv_cache_config)
    if reasons:
        raise UnsupportedConfigError("kvmem cannot serve this vLLM configuration: " + "; ".join(reasons))


def _cache_group_reasons(groups) -> list[str]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if len(groups) > 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        return [f"hybrid KV cache with {len(groups)} groups ({kinds}); kvmem needs one full-attention group"]
    for group in groups:
        spec = group.kv_cache_spec
        if type(spec) is not FullAttentionSpec:
            return [f"{type(spec).__name__} KV cache (kvmem needs plain full attention)"]
        if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
            return ["sliding-window or chunked-local attention layers (kvmem needs plain full attention)"]
    return []
