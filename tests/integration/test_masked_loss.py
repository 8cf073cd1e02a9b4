"""The step's loss where some targets do not count (IGNORE: a fine-tuning's prompt, padding): the mean over the
targets of the whole global batch that count, across micro-batches and ranks, not a mean of per-micro-batch means.
Two real gloo ranks under FSDP2, two micro-batches each, masked unevenly, against plain PyTorch on the global batch
(transformers' logits, F.cross_entropy with ignore_index): the same loss and the same gradients."""

import json
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from transformers import LlamaConfig

from trainer.config import MODEL_PRESETS, TrainingConfig
from trainer.model.build import build_model
from trainer.model.loss import IGNORE
from trainer.model.parallelize import device_mesh, parallelize
from trainer.resilience.numerics import NumericDrills

pytestmark = pytest.mark.integration

TINY = LlamaConfig(vocab_size=258, **MODEL_PRESETS["tiny"])
RANKS, MICRO_BATCHES, BATCH, SEQ = 2, 2, 2, 16
# Counted targets per (rank, micro-batch): far apart, so a mean of the four means is far from the global mean.
KEPT = {(0, 0): 3, (0, 1): 32, (1, 0): 17, (1, 1): 29}


def _global_batch() -> tuple[np.ndarray, np.ndarray]:
    """[rank, micro-batch, sample, position] inputs and targets, the targets masked to KEPT counted ones."""
    rng = np.random.default_rng(5)
    inputs = rng.integers(0, 258, (RANKS, MICRO_BATCHES, BATCH, SEQ))
    targets = rng.integers(0, 258, (RANKS, MICRO_BATCHES, BATCH, SEQ))
    for (rank, micro), kept in KEPT.items():
        flat = targets[rank, micro].reshape(-1)
        flat[rng.permutation(flat.size)[kept:]] = IGNORE
        targets[rank, micro] = flat.reshape(BATCH, SEQ)
    return inputs, targets


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    torch.set_num_threads(1)
    from trainer.job.step import forward_backward, mean_targets

    cpu = torch.device("cpu")
    training = TrainingConfig(grad_accum_steps=MICRO_BATCHES, batch_size=BATCH, seq_len=SEQ, loss_chunk=5)
    model = parallelize(build_model(TINY, seed=0), training, cpu, device_mesh(training, RANKS, cpu))
    inputs, targets = _global_batch()
    micro = [(inputs[rank, m], targets[rank, m]) for m in range(MICRO_BATCHES)]
    loss_sum, _ = forward_backward(
        model, micro, device=cpu, training_cfg=training, drills=NumericDrills([], rank, None, set()), step=1,
        first_sample=0, global_batch=RANKS * MICRO_BATCHES * BATCH,
        job_targets=lambda counted: mean_targets(counted, device=cpu, ranks=RANKS, micro_batches=MICRO_BATCHES))
    job_loss = loss_sum.clone()
    dist.all_reduce(job_loss, op=dist.ReduceOp.AVG)  # the trainer's job_mean; / grad_accum_steps: the step's loss
    grads = {name: p.grad.full_tensor().tolist() for name, p in model.named_parameters()}
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"loss": float(job_loss) / MICRO_BATCHES, "grads": grads}, handle)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_loss_is_the_mean_over_the_global_batchs_counted_targets_as_plain_pytorch_computes_it(tmp_path):
    out = tmp_path / "ranks.json"
    mp.spawn(_rank, args=(_free_port(), str(out)), nprocs=RANKS, join=True)
    ranks = json.loads(out.read_text())

    reference = build_model(TINY, seed=0)  # the same initial weights; plain transformers forward, fp32 logits
    inputs, targets = _global_batch()
    logits = reference(input_ids=torch.as_tensor(inputs.reshape(-1, SEQ))).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), torch.as_tensor(targets).reshape(-1),
                           ignore_index=IGNORE)
    loss.backward()
    assert (targets != IGNORE).sum() == sum(KEPT.values())
    assert ranks["loss"] == pytest.approx(loss.item(), rel=1e-5)
    for name, param in reference.named_parameters():
        np.testing.assert_allclose(ranks["grads"][name], param.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)

    # what a mean of each micro-batch's own mean would have trained: far from it, so the check above tells them apart
    per_micro = [F.cross_entropy(reference(input_ids=torch.as_tensor(inputs[r, m])).logits.reshape(-1, 258),
                                 torch.as_tensor(targets[r, m]).reshape(-1), ignore_index=IGNORE).item()
                 for r in range(RANKS) for m in range(MICRO_BATCHES)]
    assert abs(float(np.mean(per_micro)) - loss.item()) > 1e-3
