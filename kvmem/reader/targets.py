"""The projections a reader LoRA may adapt, apart from lora.py (torch), so that the command
table can name them without importing torch."""

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # vLLM adapts all of them
