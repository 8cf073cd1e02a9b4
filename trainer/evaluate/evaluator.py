"""The loop's evaluation, on the training's ranks: periodic validation between steps, and at the end of training the
final evaluation, the export and the champion's evaluation on the same windows.

    evaluator.periodic(step)   -> {"val_loss": ..., "val_seconds": ...} on eval.every_steps, else {}
    evaluator.final(step, checkpoint) -> the record written to <run dir>/eval/step-N.json (rank 0 of the writing group)

Why here (docs/evaluation.md): at the end of training the model is already on the GPUs, sharded; a separate job
would wait for nodes and read the checkpoint again. The final evaluation, in order:

1. the candidate: held-out loss over eval.max_batches x eval.batch_size fixed windows, the tasks (eval.tasks),
   greedy generations of eval.prompts;
2. its export (trainer.checkpoint.hf_export) by every rank, to eval.export_uri (trainer.checkpoint.export_store:
   uploaded by the ranks from FSx, export-complete.json last); a failure is recorded, the checkpoint stays;
3. the champion the train step found registered (eval/champion.json): its export read from its URI, each rank its
   rows (trainer.model.base), into this model — training is over and its state saved — and evaluated the same way.
   Files that are gone are recorded, not fatal: the gate decides (eval.champion_missing).

A job started on a finished run (nothing left to train) does only this: an evaluation job. A record that already
answers for this step and this champion is not computed again.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainer.checkpoint.export_store import (ExportIncomplete, ExportStoreError, complete_marker, download_share,
                                             read_marker, remove_local, upload_share, write_marker)
from trainer.checkpoint.hf_export import EXPORT_DTYPES, write_hf_export
from trainer.config import Config
from trainer.config.rules import is_s3_uri
from trainer.data.shards import load_meta
from trainer.data.tokenizer import document_start_token, load_tokenizer
from trainer.evaluate.heldout import Ranks, generate, heldout_loss, heldout_windows
from trainer.evaluate.lm_eval_tasks import run_lm_eval
from trainer.evaluate.tasks import TaskContext, run_tasks
from trainer.model.base import BaseModelError, index_base_weights, load_base_weights, read_base_config
from trainer.model.parallelize import local_shard
from trainer.observe.memory import peak_rss, reset_peak, return_freed_memory
from trainer.run.run_dir import RunDir, read_json, write_json

log = logging.getLogger(__name__)

# NVRx's send_heartbeat is an IPC round trip to the node's rank monitor: once a second is nothing beside a forward
# of the sharded model, and far inside any heartbeat timeout.
BEAT_EVERY_SECONDS = 1.0


@contextmanager
def beating(model: torch.nn.Module, beat: Callable[[], None], every_seconds: float):
    """A heartbeat from the model's forwards (at most one per every_seconds) while the block runs. An evaluation is
    a long series of forwards (every generated token is one; lm-eval's tasks are thousands) with no training step
    between them to beat: without these, ft_launcher takes a final evaluation longer than its heartbeat timeout for
    a hang and restarts the workers at the end of the run."""
    last = -float("inf")

    def before_forward(module, args):
        nonlocal last
        now = time.monotonic()
        if now - last >= every_seconds:
            last = now
            beat()

    handle = model.register_forward_pre_hook(before_forward)
    try:
        yield
    finally:
        handle.remove()


class Evaluator:
    def __init__(self, cfg: Config, data_dir: Path, model: torch.nn.Module, ranks: Ranks, *, tokenizer_spec: str,
                 writes: Callable[[], bool], beat: Callable[[], None]):
        """writes(): whether this process's replica group writes the run's files (it evaluates and exports);
        beat(): a heartbeat to ft_launcher between the final evaluation's parts (each can take minutes at 8B)."""
        self.cfg, self.data_dir, self.model, self.ranks = cfg, Path(data_dir), model, ranks
        self.tokenizer_spec, self.writes, self.beat = tokenizer_spec, writes, beat
        self.run_dir = RunDir(cfg.run_dir)
        self._val_windows = None

    def _agree(self, value: Any) -> Any:
        """Rank 0's value on every rank (one decision for the collective work that follows)."""
        if self.ranks.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _first_error(self, error: str | None) -> str | None:
        """Any rank's error, the same on every rank (so all of them take the same path next)."""
        errors: list[Any] = [error] * self.ranks.world_size
        if self.ranks.world_size > 1:
            dist.all_gather_object(errors, error)
        return next((e for e in errors if e), None)

    def _document_start(self) -> int | None:
        """The BOS where each held-out document begins, when training masks documents (data.document_mask)."""
        return document_start_token(load_tokenizer(self.tokenizer_spec)) if self.cfg.data.document_mask else None

    def periodic(self, step: int) -> dict[str, float]:
        every = self.cfg.eval.every_steps
        if not every or step % every:
            return {}
        started = time.perf_counter()
        if self._val_windows is None:
            try:
                self._val_windows = heldout_windows(self.data_dir, self.cfg.training.seq_len,
                                                    self.cfg.eval.batch_size, self.cfg.eval.val_batches,
                                                    self._document_start())
            except ValueError as err:  # the same data on every rank: every rank stops validating alike
                log.warning("periodic validation is off for this launch: %s", err)
                self._val_windows = False
        if self._val_windows is False:
            return {}
        was_training = self.model.training
        self.model.eval()
        try:
            with beating(self.model, self.beat, BEAT_EVERY_SECONDS):
                loss = heldout_loss(self.model, self._val_windows, self.ranks)["heldout_loss"]
        finally:
            self.model.train(was_training)
        return {"val_loss": loss, "val_seconds": time.perf_counter() - started}

    def final(self, step: int, checkpoint: str | None) -> dict[str, Any] | None:
        """Collective over the evaluating ranks; the record (None on a group that does not write the run's files)."""
        if not self.writes():
            return None  # another replica group evaluates: its ranks hold the same model
        with beating(self.model, self.beat, BEAT_EVERY_SECONDS):
            return self._final(step, checkpoint)

    def _final(self, step: int, checkpoint: str | None) -> dict[str, Any]:
        started = time.perf_counter()
        champion = read_json(self.run_dir.champion) if self.ranks.rank == 0 else None
        previous = read_json(self.run_dir.evaluation(step)) if self.ranks.rank == 0 else None
        reuse = self._agree(previous is not None and previous.get("champion_asked") == champion
                            and (previous.get("export") or {}).get("complete"))
        if reuse:
            log.info("evaluation of step %d with this champion is recorded already (%s)", step,
                     self.run_dir.evaluation(step))
            return previous
        champion = self._agree(champion)
        if self.ranks.device.type == "cpu":
            return_freed_memory()  # training is over: the heap it grew is given back, large blocks are mapped
        rss_before = reset_peak()
        self.model.eval()
        tokenizer = load_tokenizer(self.tokenizer_spec)
        windows, no_windows = None, None
        try:
            windows = heldout_windows(self.data_dir, self.cfg.training.seq_len, self.cfg.eval.batch_size,
                                      self.cfg.eval.max_batches, self._document_start())
        except ValueError as err:  # no held-out window: nothing to compare by, but the model is still exported
            no_windows = str(err)
            log.error("no held-out evaluation of step %d: %s", step, err)
        record: dict[str, Any] = {"step": step, "checkpoint": checkpoint, "run_id": self.cfg.run.run_id,
                                  "windows": windows.fingerprint if windows else None, "champion_asked": champion}
        record["candidate"] = (self._evaluate(windows, tokenizer, generations=True) if windows
                               else {"error": no_windows})
        self.beat()
        record["export"] = self._export(step, checkpoint)
        self.beat()
        if champion and windows:
            record["champion"] = {"version": champion.get("version"), "source": champion.get("source"),
                                  **self._evaluate_champion(champion, windows, tokenizer)}
        record["seconds"] = time.perf_counter() - started
        record["memory"] = self._memory(rss_before)
        if self.ranks.rank == 0:
            write_json(self.run_dir.evaluation(step), record, ensure_ascii=False)
        log.info("final evaluation of step %d: held-out loss %s%s, export %s (%.1f s)", step,
                 record["candidate"].get("heldout_loss", record["candidate"].get("error")),
                 f", champion {record['champion'].get('heldout_loss', record['champion'].get('error'))}"
                 if "champion" in record else "", record["export"].get("uri") if record["export"].get("complete")
                 else f"failed: {record['export'].get('error')}", record["seconds"])
        return record

    def _memory(self, rss_before: int) -> dict[str, list[int]]:
        """Each rank's resident memory before the final evaluation, its peak during it (evaluation, export, the
        champion's load) and its parameters' shard: what the evaluation cost over the shard it already held."""
        shard = sum(local_shard(p).nbytes for p in self.model.parameters())
        mine = [rss_before, peak_rss(), shard]
        every: list[Any] = [mine] * self.ranks.world_size
        if self.ranks.world_size > 1:
            dist.all_gather_object(every, mine)
        return {"rss_before_bytes": [r[0] for r in every], "peak_rss_bytes": [r[1] for r in every],
                "shard_bytes": [r[2] for r in every]}

    def _evaluate(self, windows, tokenizer, generations: bool) -> dict[str, Any]:
        result = heldout_loss(self.model, windows, self.ranks)
        context = TaskContext(self.model, tokenizer, self.ranks, self.cfg.eval.task_file)
        result["tasks"] = run_tasks(self.cfg.eval.task_list, context)
        eval_cfg = self.cfg.eval
        if eval_cfg.lm_eval_task_list:
            result["tasks"].update(run_lm_eval(context, eval_cfg.lm_eval_task_list,
                                               include_path=self.cfg.lm_eval_include_dir, limit=eval_cfg.lm_eval_limit,
                                               chat=eval_cfg.lm_eval_chat_template,
                                               max_length=self.cfg.training.seq_len))
        if generations and self.cfg.eval.max_new_tokens > 0:
            result["generations"] = generate(self.model, tokenizer, self.cfg.eval.prompt_list,
                                             self.cfg.eval.max_new_tokens)
        return result

    def _export(self, step: int, checkpoint: str | None) -> dict[str, Any]:
        """The HF export at cfg.export_uri(step), written by every rank; on failure the error, naming the checkpoint
        that stays (an export can be made from it again: python -m trainer.export)."""
        uri, eval_cfg = self.cfg.export_uri(step), self.cfg.eval
        to_s3 = is_s3_uri(uri)
        folder = self.run_dir.export_staging / f"step-{step:06d}" if to_s3 else Path(uri)
        error = None
        try:
            stops = (load_meta(self.data_dir).get("conversations") or {}).get("end_of_turn_ids", [])
            figures = write_hf_export(self.model, self.model.config, self.tokenizer_spec, folder,
                                      dtype=EXPORT_DTYPES[eval_cfg.export_dtype], end_of_turn_ids=stops,
                                      max_file_bytes=int(eval_cfg.export_max_file_gb * 1e9))
            if to_s3:
                figures["upload"] = upload_share(folder, uri, self.ranks.rank, self.ranks.world_size,
                                                 self.cfg.data.s3_endpoint_url, beat=self.beat)
        except (ExportStoreError, OSError) as err:
            error, figures = str(err), {}
        error = self._first_error(error)
        if error is None and self.ranks.rank == 0:
            try:
                info = {"run_id": self.cfg.run.run_id, "step": step, "checkpoint": checkpoint,
                        "dtype": eval_cfg.export_dtype}
                write_marker(uri, complete_marker(folder, info), self.cfg.data.s3_endpoint_url)
            except ExportStoreError as err:
                error = str(err)
        error = self._agree(error)
        if error is not None:
            log.error("export of step %d to %s failed: %s; the checkpoint %s stays", step, uri, error, checkpoint)
            return {"uri": uri, "complete": False, "error": error, "checkpoint": checkpoint,
                    "staging": str(folder) if to_s3 else None}
        if to_s3 and self.ranks.rank == 0:
            remove_local(folder)
        return {"uri": uri, "complete": True, **figures}

    def _evaluate_champion(self, champion: dict[str, Any], windows, tokenizer) -> dict[str, Any]:
        """The champion's export read into this model (each rank its rows) and evaluated; or why it could not be."""
        source = champion["source"]
        answer = None
        if self.ranks.rank == 0:
            try:
                answer = {"marker": read_marker(source, self.cfg.data.s3_endpoint_url)}
            except ExportIncomplete as err:
                answer = {"error": str(err)}
        answer = self._agree(answer)
        if "error" in answer:
            log.warning("champion v%s cannot be evaluated: %s", champion.get("version"), answer["error"])
            return {"error": answer["error"], "files_gone": True}
        folder = (self.cfg.fsx_root / "models" / "champions" / f"{champion.get('name', 'model')}-v{champion['version']}"
                  if is_s3_uri(source) else Path(source))
        started = time.perf_counter()
        if is_s3_uri(source):
            error = None
            try:
                download_share(source, answer["marker"], folder, self.ranks.rank, self.ranks.world_size,
                               self.cfg.data.s3_endpoint_url, beat=self.beat)
            except ExportIncomplete as err:
                error = str(err)
            error = self._first_error(error)  # also: every rank's share is there before rank 0 reads the headers
            self.beat()
            if error is not None:
                return {"error": error, "files_gone": True}
        index = None
        if self.ranks.rank == 0:
            try:
                config = read_base_config(folder)
                mismatch = [key for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                                            "num_key_value_heads", "intermediate_size")
                            if getattr(config, key) != getattr(self.model.config, key)]
                index = ({"error": f"champion v{champion['version']} at {source} has another architecture "
                                   f"({', '.join(mismatch)} differ): it cannot be evaluated in this model"}
                         if mismatch else index_base_weights(folder, config, hash_files=False))
            except BaseModelError as err:
                index = {"error": str(err)}
        index = self._agree(index)
        if "error" in index:
            return {"error": index["error"], "files_gone": False}
        load_base_weights(self.model, folder, index)
        self._first_error(None)  # every rank has read its rows
        if is_s3_uri(source) and self.ranks.rank == 0:
            remove_local(folder)  # a copy made for this evaluation: 16 GB per 8B champion would pile up on FSx
        self.beat()
        result = self._evaluate(windows, tokenizer, generations=False)
        result["load_seconds"] = time.perf_counter() - started
        return result
