"""What kvmem's connector cannot serve yet, refused at engine start-up with the reason.

Each of these would otherwise fail late or silently: tensor-parallel ranks would all write the
same blob files with a slice of the heads each; pipeline stages would pair the wrong layers;
an MLA cache holds one compressed latent per token instead of per-head K/V; an fp8 (or other
quantized) cache needs scales we do not store; hybrid cache groups (recurrent state beside
attention) give layers different block tables; a model whose every layer is sliding-window gets
vLLM's sliding-window allocator, which frees blocks outside the window, and a fact's KV must be
whole when it is copied out; layers that reuse another layer's KV (cross-layer sharing) have
no cache of their own to inject into.

Sliding-window layers beside full-attention ones (Gemma 2/3, hybrid Qwen) are served: with a
connector that does not opt into vLLM's hybrid allocator, vLLM keeps every token's blocks for
them and applies the window in the attention kernel, exactly as for text prefill.
"""

from __future__ import annotations

from pathlib import Path

from kvmem.errors import UnsupportedConfigError

# vLLM reports a worker's failure at start-up as "Engine core initialization failed"; the reason
# itself only reaches the log. The connector leaves it here (in kv_dir) for the engine to raise.
REFUSAL_FILE = "refused.txt"

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


def layer_reasons(layers: dict) -> list[str]:
    """Reasons found on the attention layers themselves (only the worker has them loaded)."""
    shared = sorted(name for name, layer in layers.items() if getattr(layer, "kv_sharing_target_layer_name", None))
    if shared:
        return [f"cross-layer KV sharing ({len(shared)} layers reuse another layer's KV, e.g. {shared[0]})"]
    return []


def refuse_unsupported(vllm_config, kv_cache_config, report_dir: Path | None = None) -> None:
    """Raise UnsupportedConfigError listing every reason (also written to report_dir), or return."""
    reasons = unsupported(vllm_config.parallel_config, vllm_config.model_config, vllm_config.cache_config,
                          kv_cache_config)
    reasons += layer_reasons(vllm_config.compilation_config.static_forward_context)
    if reasons:
        message = "kvmem cannot serve this vLLM configuration: " + "; ".join(reasons)
        if report_dir is not None:
            Path(report_dir).mkdir(parents=True, exist_ok=True)
            (Path(report_dir) / REFUSAL_FILE).write_text(message)
        raise UnsupportedConfigError(message)


def take_refusal(report_dir: Path) -> str | None:
    """The refusal a connector left in report_dir at start-up (removed once read), or None."""
    path = Path(report_dir) / REFUSAL_FILE
    try:
        message = path.read_text()
    except FileNotFoundError:
        return None
    path.unlink(missing_ok=True)
    return message


def map_refusal_file(report_dir: Path, fingerprint: str, what: str = "reader-map") -> Path:
    """Where a worker says why it refused something of this start (`what`: "reader-map", the
    reader's KV map, reader/kvmap.py; "recompute", connector/recompute.py), for the engine's
    other processes: the scheduler side is built after the worker registered its caches (vLLM's
    EngineCore sets up the KV caches before the scheduler), and reads it then."""
    return Path(report_dir) / f"{what}-refused-{fingerprint[:16]}.txt"


def leave_map_refusal(report_dir: Path, fingerprint: str, reason: str | None, what: str = "reader-map") -> None:
    """Record the worker's verdict of this start: why it refused `what`, or (None) that it
    took it, which clears an earlier start's refusal."""
    path = map_refusal_file(report_dir, fingerprint, what)
    if reason is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(reason)


def map_refused(report_dir: Path | None, fingerprint: str, what: str = "reader-map") -> str | None:
    """Why this start's worker refused `what`, or None (it took it, or had none)."""
    if report_dir is None:
        return None
    try:
        return map_refusal_file(report_dir, fingerprint, what).read_text()
    except FileNotFoundError:
        return None


def _cache_group_reasons(groups) -> list[str]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if len(groups) > 1:
        kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups)
        return [f"hybrid KV cache with {len(groups)} groups ({kinds}); kvmem needs one full-attention group"]
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            return [f"sliding-window attention in every layer (window {spec.sliding_window}): vLLM frees blocks "
                    "outside the window, which kvmem's encodes need whole"]
        if type(spec) is not FullAttentionSpec:
            return [f"{type(spec).__name__} KV cache (kvmem needs attention with a per-token K/V cache)"]
        if getattr(spec, "attention_chunk_size", None):
            return ["chunked-local attention layers (not yet tested with injection)"]
    return []
