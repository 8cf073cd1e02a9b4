"""Fine-tuning on conversations (data.format chat / prompt_completion): staged from jsonl, jsonl.gz and parquet,
rendered by the tokenizer's chat template, the assistant's turns the only targets, packed without cross-talk; and a
real 2-rank run that learns an answer only from the assistant's turns."""

import gzip
import json
import random
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from components.train.local import run_local_training
from tests.base_model import train_tokenizer
from tests.metrics import losses_by_step
from trainer.config.data import DataConfig
from trainer.data.batches import IGNORE, TokenBatches
from trainer.data.conversations import conversation_format
from trainer.data.shards import DataError, tokenize_files
from trainer.data.tokenizer import load_tokenizer
from trainer.evaluate.lm_eval_tasks import metrics_of, task_specs
from trainer.run.events import read_events
from trainer.run.run_dir import RunDir, read_json, read_jsonl

pytestmark = pytest.mark.integration

ANSWER = "The answer is forty two."
CAPITALS_TEXT = str(Path(__file__).parents[1] / "data" / "lm_eval" / "capitals_text.yaml")
LM_EVAL = {"assistant": [f"--eval.lm_eval_tasks={CAPITALS_TEXT}"], "all": []}
SEQ_LEN = 128


def _conversation(rng: random.Random) -> dict:
    """A user turn of random letters (nothing to learn) and always the same answer."""
    question = "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(rng.randint(8, 24)))
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": ANSWER}]}


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    rng = random.Random(0)
    train_tokenizer([ANSWER] * 20 + [_conversation(rng)["messages"][0]["content"] for _ in range(200)]
                    ).save_pretrained(folder)
    return str(folder)


def _corpus(folder: Path, records: int, seed: int = 0) -> list[Path]:
    """The records over a .jsonl, a .jsonl.gz and a .parquet file (a messages column of list<struct>)."""
    rng = random.Random(seed)
    conversations = [_conversation(rng) for _ in range(records)]
    third = records // 3
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations[:third]))
    with gzip.open(folder / "b.jsonl.gz", "wt") as handle:
        handle.write("".join(json.dumps(c) + "\n" for c in conversations[third:2 * third]))
    pq.write_table(pa.Table.from_pylist(conversations[2 * third:]), folder / "c.parquet")
    return sorted(folder.iterdir())


def test_a_chat_corpus_is_staged_into_packed_rows_whose_targets_are_the_assistants_turns(tmp_path, chat_tokenizer):
    files = _corpus(tmp_path / "raw", 300)
    fmt = conversation_format(DataConfig(format="chat"), SEQ_LEN)
    meta = tokenize_files(files, tmp_path / "tokens", 0.1, chat_tokenizer, conversations=fmt)
    train, val = meta["splits"]["train"], meta["splits"]["val"]
    assert train["documents"] + val["documents"] == 300 and val["documents"] > 0
    end_of_turn = load_tokenizer(chat_tokenizer).tokenizer.token_to_id("<|eot_id|>")
    assert meta["conversations"] == {"format": "chat", "seq_len": SEQ_LEN, "loss_on": "assistant", "too_long": "drop",
                                     "end_of_turn_ids": [end_of_turn]}
    # packing: several conversations a row, far less padding than one a row
    unpacked = 1 - train["conversation_tokens"] / (train["documents"] * (SEQ_LEN + 1))
    packed = 1 - train["conversation_tokens"] / train["tokens"]
    print(f"padding share of the rows: {unpacked:.3f} one conversation a row, {packed:.3f} packed")
    assert train["rows"] < train["documents"] / 1.5 and packed < unpacked / 2

    loaded = load_tokenizer(chat_tokenizer)
    batches = TokenBatches.open(tmp_path / "tokens", "train", SEQ_LEN, batch_size=4, seed=1)
    assert batches.masks_targets
    inputs, labels, positions = batches.samples(np.arange(8))
    assert inputs.shape == labels.shape == positions.shape == (8, SEQ_LEN)
    for row_labels, row_positions in zip(labels, positions):
        targets = loaded.tokenizer.decode(row_labels[row_labels != IGNORE].tolist(), skip_special_tokens=False)
        conversations = int((row_positions == 0).sum())  # each starts at position 0 (and so does the padding)
        assert targets.count(ANSWER + "<|eot_id|>") in (conversations, conversations - 1)
        assert targets.replace(ANSWER + "<|eot_id|>", "") == ""  # no user or template token is a target
    assert int((labels != IGNORE).sum()) > 0 and (positions[:, 0] == 0).all()


def test_bad_records_fail_naming_the_file_and_line_or_are_skipped_and_counted(tmp_path, chat_tokenizer):
    raw = tmp_path / "raw"
    files = _corpus(raw, 30)
    lines = (raw / "a.jsonl").read_text().splitlines()
    lines[3] = json.dumps({"messages": [{"role": "user", "content": "no answer"}]})
    lines[6] = json.dumps({"text": "a pre-training document"})
    lines[7] = json.dumps({"messages": [{"role": "user", "content": "x " * 400}, {"role": "assistant",
                                                                                  "content": ANSWER}]})
    (raw / "a.jsonl").write_text("\n".join(lines) + "\n")

    with pytest.raises(DataError, match=r"a\.jsonl:4: the 'messages' field has no assistant turn.*data\.bad_records"):
        tokenize_files(files, tmp_path / "tokens", 0.1, chat_tokenizer,
                       conversations=conversation_format(DataConfig(format="chat"), SEQ_LEN))
    assert not (tmp_path / "tokens" / "tokens.json").exists()

    skipping = conversation_format(DataConfig(format="chat", bad_records="skip"), SEQ_LEN)
    meta = tokenize_files(files, tmp_path / "tokens", 0.1, chat_tokenizer, conversations=skipping)
    counts = {key: meta["splits"]["train"][key] + meta["splits"]["val"][key]
              for key in ("documents", "bad_records", "dropped", "truncated")}
    assert counts == {"documents": 27, "bad_records": 2, "dropped": 1, "truncated": 0}

    truncating = conversation_format(DataConfig(format="chat", bad_records="skip", too_long="truncate", loss_on="all"),
                                     SEQ_LEN)
    meta = tokenize_files(files, tmp_path / "truncated", 0.1, chat_tokenizer, conversations=truncating)
    assert sum(meta["splits"][s]["truncated"] for s in ("train", "val")) == 1
    assert sum(meta["splits"][s]["documents"] for s in ("train", "val")) == 28


def test_prompt_completion_pairs_target_the_completion(tmp_path, chat_tokenizer):
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = random.Random(3)
    (raw / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": "".join(rng.choice("abc ") for _ in range(10)), "completion": " " + ANSWER}) + "\n"
        for _ in range(60)))
    tokenize_files([raw / "pairs.jsonl"], tmp_path / "tokens", 0.1, chat_tokenizer,
                   conversations=conversation_format(DataConfig(format="prompt_completion"), SEQ_LEN))
    loaded = load_tokenizer(chat_tokenizer)
    _, labels, _ = TokenBatches.open(tmp_path / "tokens", "train", SEQ_LEN, 2, seed=0).samples(np.arange(4))
    for row in labels:
        targets = loaded.tokenizer.decode(row[row != IGNORE].tolist(), skip_special_tokens=False)
        assert targets and targets.replace(" " + ANSWER + "<|end_of_text|>", "") == ""


PLAIN_CHAT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder, questions = sys.argv[1], json.loads(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
answers = []
for question in questions:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    answers.append(tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
print(json.dumps(answers))
"""


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_a_fine_tuned_model_answers_through_its_chat_template_only_from_the_assistants_turns(
        loss_on, tmp_path, chat_tokenizer, training_config):
    """Targets on the assistant's turns only: the loss falls near 0 (the answer is always the same) and the export,
    prompted through its chat template in plain transformers, answers it. On every token (loss_on=all) the random
    user turns keep the loss far from 0. The assistant run loses a rank to SIGKILL at step 42 and resumes from node
    memory (copies every 4 steps): the steps it trains again compute the same losses, bit for bit."""
    steps = 60
    fault = "sigkill@42:rank=1" if loss_on == "assistant" else ""
    cfg = training_config(tmp_path, f"sft-{loss_on}", "--data.format=chat", f"--data.loss_on={loss_on}",
                          f"--data.tokenizer={chat_tokenizer}", f"--training.seq_len={SEQ_LEN}",
                          f"--training.num_steps={steps}", f"--checkpoint.interval_steps={steps}",
                          "--checkpoint.memory_interval_steps=4", "--training.lr=3e-3", f"--faults.schedule={fault}",
                          "--resilience.straggler_interval=0", *LM_EVAL[loss_on])
    tokens = cfg.fsx_root / "datasets" / "chat"
    tokenize_files(_corpus(tmp_path / "raw", 400), tokens, 0.1, chat_tokenizer,
                   conversations=conversation_format(cfg.data, SEQ_LEN))

    assert run_local_training(cfg, tokens)["steps"] == steps
    by_step = losses_by_step(cfg.run_dir / "metrics.jsonl")  # (asserts every step trained again: the same loss)
    assert sorted(by_step) == list(range(1, steps + 1))
    trained = [int(r["step"]) for r in read_jsonl(cfg.run_dir / "metrics.jsonl")]
    assert (len(trained) > steps) == bool(fault)  # the fault's run trained steps 41-42 again
    losses = [by_step[step] for step in sorted(by_step)]
    final = float(np.mean(losses[-5:]))
    print(f"loss_on={loss_on}: first {losses[0]:.3f}, last 5 steps {final:.4f}")
    record = read_json(RunDir(cfg.run_dir).evaluation(steps))
    if loss_on == "all":
        assert final > 1.0, losses
        return
    assert final < 0.05, losses
    assert record["candidate"]["heldout_loss"] < 0.05  # the held-out conversations' assistant turns
    export = Path(record["export"]["uri"])
    questions = ["xkq mz pwo", "hello who are you", "qqqq"]
    proc = subprocess.run([sys.executable, "-c", PLAIN_CHAT, str(export), json.dumps(questions)], cwd=tmp_path,
                          capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == [ANSWER] * 3

    # an lm-eval task scored on the 2 training ranks (the sharded model) = lm-eval's own HF model on the export
    from lm_eval import simple_evaluate

    theirs = metrics_of(simple_evaluate(
        model="hf", model_args={"pretrained": str(export), "dtype": "float32", "device": "cpu", "max_length": SEQ_LEN},
        tasks=task_specs([CAPITALS_TEXT]), bootstrap_iters=0, log_samples=False, verbosity="ERROR"))
    ranks = record["candidate"]["tasks"]["lm_eval:capitals_text"]["metrics"]
    print(f"lm-eval capitals_text from the ranks {ranks}, lm-eval's HF model on the export {theirs['capitals_text']}")
    assert ranks == pytest.approx(theirs["capitals_text"], rel=1e-4)


def test_a_chat_corpus_needs_a_tokenizer_with_a_chat_template(tmp_path):
    """The byte tokenizer has no chat template: the stage fails with exit code 2's error naming data.tokenizer."""
    from trainer.config.rules import InputError

    with pytest.raises(InputError, match="needs a tokenizer with a chat template.*data.tokenizer"):
        tokenize_files(_corpus(tmp_path / "raw", 6), tmp_path / "tokens", 0.1, "byte",
                       conversations=conversation_format(DataConfig(format="chat"), SEQ_LEN))


def test_fine_tuning_in_two_replica_groups_rolls_back_a_nan_alike_and_heals_a_killed_group(
        tmp_path, chat_tokenizer, training_config):
    """The resilience paths of a fine-tuning run (packed conversations, targets on the assistant's turns): two
    replica groups; a NaN batch at step 6 judged by both groups alike (the loss is averaged across groups first),
    both rolled back to step 4 and skipping the same samples; then group 1 SIGKILLed at step 14, group 0 training
    alone until group 1 heals from it. The groups agree on every step both trained; the run still learns."""
    steps = 24
    cfg = training_config(tmp_path, "sft-groups", "--data.format=chat", f"--data.tokenizer={chat_tokenizer}",
                          f"--training.seq_len={SEQ_LEN}", f"--training.num_steps={steps}", "--training.lr=3e-3",
                          "--training.num_nodes=2", "--training.replica_groups=2", "--checkpoint.interval_steps=4",
                          "--resilience.heartbeat_timeout=30", "--resilience.quorum_timeout_seconds=20",
                          "--resilience.replica_check_interval=1", "--resilience.lighthouse_heartbeat_timeout_seconds=0.5",
                          "--resilience.rollback_steps=2", "--resilience.skip_steps=2",
                          "--local.node_replacement_delay_seconds=1", "--resilience.straggler_interval=0",
                          "--faults.schedule=nan@6:rank=1,sigkill@14:rank=3")
    tokens = cfg.fsx_root / "datasets" / "chat"
    tokenize_files(_corpus(tmp_path / "raw", 400), tokens, 0.1, chat_tokenizer,
                   conversations=conversation_format(cfg.data, SEQ_LEN))

    assert run_local_training(cfg, tokens)["steps"] == steps
    records = read_jsonl(cfg.run_dir / "metrics.jsonl")
    participants = {int(r["step"]): r["participants"] for r in records}
    assert sorted(participants) == list(range(1, steps + 1)) and participants[steps] == 2
    both = [r for r in records if r["participants"] == 2]
    assert both and all(r.get("replicas_equal") is True for r in both)
    assert all(np.isfinite(r["loss"]) for r in records)
    rollbacks = read_events(cfg.run_dir, "rollback")
    assert sorted((r["group"], r["anomaly_step"], r["reloaded_step"]) for r in rollbacks) == [(0, 6, 4), (1, 6, 4)]
    skipped = read_events(cfg.run_dir, "data_skipped")
    assert len({(s["start"], s["end"]) for s in skipped}) == 1 and {s["group"] for s in skipped} == {0, 1}
    heals = read_events(cfg.run_dir, "replica_group_heal")
    assert sorted(h["rank"] for h in heals) == [2, 3] and {h["donor_group"] for h in heals} == {0}
    assert any(count == 1 for step, count in participants.items() if step > 14)  # group 0 alone meanwhile
    assert np.mean([r["loss"] for r in records[-3:]]) < 0.5  # the answer learnt from the assistant's turns


def test_a_fine_tuning_run_extended_with_another_chat_corpus_goes_on_in_a_new_data_phase(
        tmp_path, chat_tokenizer, training_config):
    """A weekly fine-tune extended mid-way with more conversations: the same run id, more steps, a mixture that adds
    a second chat corpus (data.on_mixture_change=new_phase; its refusal without it is format-blind and tested on
    text: tests/integration/test_continuation.py). Steps 1-4 stay as trained, the rows after the boundary are
    drawn 1 : 1 from the two corpora, the LR goes on from where it was, and the targets stay the assistant's."""
    from components.stage.shards import write_mixture
    from trainer.config import DatasetConfig

    shape = ["--data.format=chat", f"--data.tokenizer={chat_tokenizer}", f"--training.seq_len={SEQ_LEN}",
             "--checkpoint.interval_steps=2", "--faults.schedule=", "--eval.max_batches=1", "--eval.every_steps=0",
             "--resilience.straggler_interval=0", "--training.warmup_steps=2", "--training.lr=3e-3"]
    first = training_config(tmp_path, "sft-extend", *shape, "--training.num_steps=4")
    fmt = conversation_format(first.data, SEQ_LEN)
    tokens = {name: tokenize_files(_corpus(tmp_path / f"{name}-raw", 240, seed), tmp_path / name, 0.1,
                                   chat_tokenizer, conversations=fmt)
              for seed, name in enumerate(("support", "sales"))}
    mixtures = {"first": {"support": 1}, "second": {"support": 1, "sales": 1}}
    for folder, weights in mixtures.items():
        write_mixture(tmp_path / folder, [(DatasetConfig(name=name, weight=weight), tmp_path / name, tokens[name])
                                          for name, weight in weights.items()])
    assert run_local_training(first, tmp_path / "first")["steps"] == 4
    trained = {int(r["step"]): (r["loss"], r["lr"]) for r in read_jsonl(first.run_dir / "metrics.jsonl")}

    phased = training_config(tmp_path, "sft-extend", *shape, "--training.num_steps=8",
                             "--data.on_mixture_change=new_phase")
    assert run_local_training(phased, tmp_path / "second")["steps"] == 8
    phases = read_events(phased.run_dir, "data_phase")
    assert [(p["phase"], p["start"], p["step"]) for p in phases] == [(0, 0, 0), (1, 32, 4)]  # 2 ranks x 4 rows
    records = {int(r["step"]): r for r in read_jsonl(phased.run_dir / "metrics.jsonl")}
    assert {s: (records[s]["loss"], records[s]["lr"]) for s in range(1, 5)} == trained
    last = records[8]
    assert (last["samples/support"], last["samples/sales"]) == (32 + 16, 16)
    floor = first.training.lr * first.training.min_lr_ratio  # the cosine ended at the first horizon
    assert [records[s]["lr"] for s in range(5, 9)] == [pytest.approx(floor)] * 4
    # the new phase's rows are packed conversations whose only targets are the assistant's: the loss keeps falling
    assert all(np.isfinite(records[s]["loss"]) for s in range(1, 9)) and records[8]["loss"] < records[1]["loss"]
