"""The evaluate step as a KFP component (its logic: step.run_evaluate)."""

from kfp.dsl import Metrics, Output


def evaluate_model(config_json: str, overrides: list, kfp_job_id: str, checkpoint: str,
                   metrics: Output[Metrics]) -> float:
    """The training ranks' evaluation of the checkpoint, logged, and the promotion gate; returns the held-out loss.
    Loads no weights: it runs in a small pod."""
    # Imports inside: KFP runs this function's source alone in the task.
    from components.context import resolve_config
    from components.evaluate.step import run_evaluate
    from trainer.observe import logs

    logs.configure()
    result = run_evaluate(resolve_config(config_json, overrides, kfp_job_id), checkpoint)
    for key in ("heldout_loss", "perplexity", "eval_tokens_per_second"):
        metrics.log_metric(key, float(result[key]))
    metrics.log_metric("promoted", float(bool((result.get("promotion") or {}).get("promote"))))
    return result["heldout_loss"]
