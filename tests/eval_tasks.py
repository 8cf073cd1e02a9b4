"""Evaluation tasks for the tests (eval.tasks entry points): one that raises, one that reads the model."""


def raises(context):
    raise RuntimeError("the task's data file is unreadable")


def vocabulary(context):
    return {"vocab_size": context.model.config.vocab_size, "ranks": context.ranks.world_size}
