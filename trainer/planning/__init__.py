"""Checkpoint-interval planning: measured costs in, the interval per tier and the goodput of each recovery
configuration out (trainer.planning.goodput, closed form), and a seeded simulation of a job to check it
(trainer.planning.simulate)."""
