"""What transformers' GGUF loader drops or blurs for Gemma 3, put back when the folder is written.

The Gemma 3 270M GGUF has no chat template (kvmem's prompts are built from one); the loader
drops its add_bos_token (Gemma without <bos> is far worse, and vLLM tokenizes plain prompts with
the tokenizer's own special tokens); its RMSNorm epsilon comes back as float32's 9.99999997e-07
instead of google's 1e-06; and a chat turn ends with <end_of_turn>, which is not the EOS.
"""

from __future__ import annotations

END_OF_TURN_ID = 106  # <end_of_turn> in Gemma 3's vocabulary

# Gemma 3's own template (google/gemma-3-*-it), images dropped: a system message becomes the
# first user turn's prefix; the assistant's role is spelled "model".
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""


def fix_config(config: dict) -> None:
    """1e-06 as google wrote it; no temp-folder path, so reconverting gives the same fingerprint."""
    config["rms_norm_eps"] = 1e-06
    config.pop("_name_or_path", None)


def fix_generation(generation) -> None:
    """Stop at <end_of_turn> too, as google's generation_config does: vLLM reads these ids."""
    eos = generation.eos_token_id
    ids = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    generation.eos_token_id = ids + [END_OF_TURN_ID] * (END_OF_TURN_ID not in ids)


def fix_tokenizer(tokenizer) -> None:
    """<bos> first, as the GGUF's tokenizer.ggml.add_bos_token says; Gemma 3's chat template
    when the GGUF carries none (this one does not)."""
    tokenizer.add_bos_token = True
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHAT_TEMPLATE
