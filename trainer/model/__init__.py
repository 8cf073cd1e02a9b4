"""The neural model: the families a base model may be (families.py), its build (build.py) and FSDP2 sharding
(parallelize.py), the optimizer (optimizer.py)."""
