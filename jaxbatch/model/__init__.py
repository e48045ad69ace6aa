"""The model: architecture config (arch.py), the forward passes over a params pytree (archs/),
weights from HF directories and GGUF files (hf.py, gguf/, weights.py, loader.py) and their
quantised forms (quantize.py)."""
