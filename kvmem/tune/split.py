"""Evaluation hygiene: the LoCoMo conversations tuning may read. Results are reported on the
others (conv-42, conv-43, conv-44, conv-47), never tuned on. Torch-free, for the command table."""

TUNE_CONVERSATIONS = ("conv-26", "conv-30", "conv-41")  # never the ones results are reported on
