"""Checkpoints: the format (format.py), the write backends (backends.py), the manager that saves and decides
where a run resumes from (manager.py: a façade over commit.py, retention.py, resume.py and costs.py), the
node-memory and peer tiers (node_store.py, state_bytes.py, peer.py, memory.py), S3 (s3_tier.py), the reader
(fast_reader.py, tensor_decode.py, prefetch.py, load.py) and export.py.
Import the submodule you need: the format is light, the manager and backends import torch."""
