"""Llama-family decoder: architecture config, pure forward over a params pytree, loaders."""
