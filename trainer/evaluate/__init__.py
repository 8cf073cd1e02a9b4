"""Evaluation on the training's ranks: held-out loss, tasks, generations, the final evaluation and export."""
