"""llama.cpp GGUF files: the reader (config, tokenizer, tensors kept in their blocks) and the
MoE config's keys."""
