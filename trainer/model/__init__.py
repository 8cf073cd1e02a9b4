"""The neural model: the Llama build and its FSDP2 sharding (llama.py), the optimizer (optimizer.py)."""
