"""The architectures' forward passes, pure functions over a params pytree: the Llama family with
its dense and MoE variants (llama.py, moe.py), gpt-oss's pieces (gpt_oss.py), rotary tables
(rope.py)."""
