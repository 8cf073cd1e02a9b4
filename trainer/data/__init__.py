"""The data: tokenizers (tokenizer.py), token shards on disk (shards.py), and the batches a rank trains on
(batches.py)."""
