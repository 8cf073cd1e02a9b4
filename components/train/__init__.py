"""The train step: its KFP wrapper (component.py) and its logic (step.py and the modules beside it)."""
