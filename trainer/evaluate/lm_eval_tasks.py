"""lm-evaluation-harness tasks on the training's ranks (eval.lm_eval_tasks): the sharded model behind lm-eval's `LM`
interface, scored the way lm-eval's own Hugging Face model (HFLM) scores an exported model.

    results = run_lm_eval(context, ["tests/data/lm_eval/capitals.yaml"], include_path="", limit=0, chat=False)

Every rank runs the same lm-eval evaluation (lm-eval sees one process); the adapter deals each batch of scoring
requests out to the ranks and gathers the scores (trainer.evaluate.heldout.score_sequences), and generates the same
tokens on every rank (the model is sharded: each forward is a collective). As HFLM does by default: text is encoded
without special tokens, trailing spaces of a context move to its continuation, an empty context is the BOS (else
EOS) token, long inputs keep their last max_length tokens, rolling log-likelihoods use lm-eval's own disjoint
windows, and generation stops at EOS or the first `until` string. A task's YAML names its data (a local jsonl or
parquet); nothing is downloaded at run time (HF_DATASETS_OFFLINE).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from trainer.evaluate.heldout import greedy_continuation, score_sequences

log = logging.getLogger(__name__)

TASK_PREFIX = "lm_eval:"


def _lm_class():
    # lm-eval only where its tasks run: importing it costs seconds (datasets, evaluate) every evaluation would pay
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class ShardedLM(TemplateLM):
        """The sharded model as an lm-eval LM (one process to lm-eval; the ranks share the work inside). lm-eval's
        TemplateLM turns (context, continuation) into tokens, with tok_encode as HFLM's."""

        backend = "causal"

        def __init__(self, context, max_length: int):
            super().__init__()
            self.context, self.max_length = context, max_length
            self.tokenizer = hf_tokenizer_of(context.tokenizer)

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            bos = self.tokenizer.bos_token_id
            return bos if bos is not None else self.tokenizer.eos_token_id

        @property
        def tokenizer_name(self) -> str:
            return self.context.tokenizer.name.replace("/", "__")

        def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
            return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            # HFLM's: the tokenizer's own special tokens unless told, none when the text starts with the BOS
            options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
                options["add_special_tokens"] = False
            return self.tokenizer.encode(string, **options)

        def tok_decode(self, tokens: list[int]) -> str:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            sequences = []
            for _, head, tail in requests:
                ids = (list(head) + list(tail))[-(self.max_length + 1):]
                sequences.append((ids, len(ids) - len(tail)))
            scores = score_sequences(self.context.model, sequences, self.context.ranks, greedy=True)
            return [(score, greedy) for score, _, greedy in scores]

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            windows, owners = [], []
            for index, request in enumerate(requests):
                for head, tail in map(make_disjoint_window, get_rolling_token_windows(
                        token_list=self.tok_encode(request.args[0]), prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length, context_len=1)):
                    windows.append((None, head, tail))
                    owners.append(index)
            totals = [0.0] * len(requests)
            for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows)):
                totals[owner] += score
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            out = []
            for request in requests:
                context, gen_kwargs = request.args
                gen_kwargs = dict(gen_kwargs or {})
                until = gen_kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(gen_kwargs.get("max_gen_toks", 256))
                ids = self.tok_encode(context)[-max(1, self.max_length - max_new):] or [self.prefix_token_id]

                def done(tokens: list[int]) -> bool:
                    return tokens[-1] == self.eot_token_id or any(u in self.tok_decode(tokens) for u in until)

                text = self.tok_decode(greedy_continuation(self.context.model, ids, max_new, done))
                for stop in until:
                    text = text.split(stop)[0]
                out.append(text)
            return out

    return ShardedLM


def hf_tokenizer_of(loaded):
    """transformers' tokenizer of a LoadedTokenizer: its folder's (the chat template, its decode settings), or the
    built-in byte tokenizer's object."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # only for lm-eval and chat templates

    if loaded.folder is not None:
        return AutoTokenizer.from_pretrained(str(loaded.folder))
    return PreTrainedTokenizerFast(tokenizer_object=loaded.tokenizer, bos_token=loaded.bos_token,
                                   eos_token=loaded.eos_token, clean_up_tokenization_spaces=False)


def task_specs(tasks: list[str], include_path: str = "") -> list[Any]:
    """lm-eval's task arguments: a YAML file, or the YAML in `include_path` whose `task` is the name, becomes its
    config (data files relative to its folder made absolute); another name stays a name for lm-eval to find."""
    # lm-eval only here (its import costs seconds); >= 0.4.10 loads a task YAML as its CLI does (!function, include)
    try:
        from lm_eval.tasks._yaml_loader import load_yaml as load_yaml_config  # (lm-eval: see above)
    except ImportError:
        # earlier 0.4 releases
        from lm_eval.utils import load_yaml_config

    named = {}
    for candidate in sorted(Path(include_path).rglob("*.y*ml")) if include_path else []:
        try:
            name = load_yaml_config(str(candidate)).get("task")
        except Exception:  # noqa: BLE001 - another YAML in the folder (a group, an include): lm-eval reads it
            continue
        if isinstance(name, str):
            named.setdefault(name, candidate)
    specs = []
    for task in tasks:
        path = named.get(task, Path(task))
        if path.suffix not in (".yaml", ".yml"):
            specs.append(task)
            continue
        if not path.is_file():
            raise FileNotFoundError(f"eval.lm_eval_tasks: {path} does not exist")
        config = load_yaml_config(str(path))
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        if files is not None:
            config["dataset_kwargs"]["data_files"] = _absolute(files, path.parent)
        specs.append(config)
    return specs


def _absolute(files, folder: Path):
    if isinstance(files, str):
        return files if "://" in files or Path(files).is_absolute() else str((folder / files).resolve())
    if isinstance(files, list):
        return [_absolute(f, folder) for f in files]
    return {split: _absolute(f, folder) for split, f in files.items()}


def metrics_of(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's results: "acc,none" is "acc", another filter's "acc,strict" is
    "acc/strict"; standard errors kept as "<metric>_stderr" when lm-eval computed them."""
    out = {}
    for task, values in results.get("results", {}).items():
        metrics = {}
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, _, filter_name = key.partition(",")
            metrics[metric if filter_name == "none" else f"{metric}/{filter_name}"] = float(value)
        out[task] = metrics
    return out


def _shared(results: dict | None, ranks) -> dict:
    """lm-eval returns its results only where LOCAL_RANK is 0 (its rule for torchrun): every rank takes those."""
    if ranks.world_size == 1:
        return results
    import torch.distributed as dist  # (only with several ranks)

    every: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(every, results)
    return next(r for r in every if r is not None)


def run_lm_eval(context, tasks: list[str], *, include_path: str = "", limit: int = 0, chat: bool = False,
                max_length: int = 2048) -> dict[str, dict[str, Any]]:
    """Each task's record under `lm_eval:<task>`: its metrics and seconds, or the error every task of this call
    shares (an lm-eval failure is recorded, and the gate decides, as for eval.tasks)."""
    started = time.perf_counter()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a task's data is local: never a hub download mid-run
    try:
        # lm-eval only where its tasks run (seconds of imports: datasets, evaluate)
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=include_path or None, verbosity="ERROR")
        results = simple_evaluate(model=_lm_class()(context, max_length), tasks=task_specs(tasks, include_path),
                                  task_manager=manager, limit=limit or None, apply_chat_template=chat,
                                  log_samples=False, bootstrap_iters=0, verbosity="ERROR")
    except Exception as err:  # noqa: BLE001 - a user's task: recorded under its name, the gate decides
        error = {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - started}
        log.error("lm-eval tasks %s failed: %s", ", ".join(tasks), error["error"])
        return {f"{TASK_PREFIX}{Path(task).stem if task.endswith(('.yaml', '.yml')) else task}": dict(error)
                for task in tasks}
    results = _shared(results, context.ranks)
    seconds = time.perf_counter() - started
    recorded = {}
    for task, metrics in metrics_of(results).items():
        recorded[f"{TASK_PREFIX}{task}"] = {"metrics": metrics, "seconds": seconds}
        log.info("lm-eval task %s: %s", task, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return recorded
