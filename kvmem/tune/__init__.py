"""Offline tuning of the reader adapter (`kvmem tune-reader`): KV mode rebuilt in PyTorch
(transformers) to measure where it parts from text prefill (lab.py, measure.py), training
examples from LoCoMo (examples.py), training (train.py) and the command (cli.py). No vLLM here;
what it writes is read by kvmem.reader.
"""
