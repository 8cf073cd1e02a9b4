"""The pipeline's steps, a folder each (prepare, stage, train, validate, evaluate, finalize): a thin KFP
wrapper (component.py), the step's logic without KFP (step.py) and its domain modules; plus what every step
shares (context.py: the run's config and MLflow run; tracking.py: MLflow through a spool)."""
