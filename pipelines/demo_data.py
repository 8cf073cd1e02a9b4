"""The demo corpus: generated deterministically, no downloads, with structure a tiny model can learn.

Documents are short stories from a small grammar (subjects, verbs, places that agree) plus arithmetic
facts, so the loss falls well below the ~5.5 nats of uniform bytes within a few hundred steps.
"""

from __future__ import annotations

import json
import logging
import random

from botocore.exceptions import BotoCoreError, ClientError

from components.stage.s3_copy import s3_client, s3_error

log = logging.getLogger(__name__)

_SUBJECTS = ["the cat", "the dog", "a small bird", "the old man", "my sister", "the farmer", "a red fox",
             "the teacher", "our neighbour", "the tired horse"]
_VERBS = ["walked to", "ran into", "looked at", "sat near", "jumped over", "slept beside", "painted",
          "cleaned", "found", "visited"]
_PLACES = ["the river", "the garden", "the big house", "the market", "the green hill", "the school",
           "the kitchen", "the forest", "the old bridge", "the station"]
_TIMES = ["in the morning", "at noon", "after dinner", "on sunday", "at night", "before the rain"]
_ENDINGS = ["and smiled.", "and went home.", "and said hello.", "and was happy.", "and then rested."]


def _story(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 5)):
        sentences.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_PLACES)} "
                         f"{rng.choice(_TIMES)} {rng.choice(_ENDINGS)}")
    return " ".join(s[0].upper() + s[1:] for s in sentences)


def _arithmetic(rng: random.Random) -> str:
    facts = []
    for _ in range(rng.randint(3, 6)):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        facts.append(f"{a} + {b} = {a + b}.")
    return " ".join(facts)


def generate_documents(num_documents: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [_arithmetic(rng) if rng.random() < 0.25 else _story(rng) for _ in range(num_documents)]


def demo_files(num_documents: int, num_files: int = 4, seed: int = 0) -> dict[str, bytes]:
    """{file name: jsonl bytes}, documents dealt round-robin into num_files files."""
    documents = generate_documents(num_documents, seed)
    files: dict[str, list[str]] = {f"part-{i:03d}.jsonl": [] for i in range(num_files)}
    names = list(files)
    for index, document in enumerate(documents):
        files[names[index % num_files]].append(json.dumps({"text": document}))
    return {name: ("\n".join(lines) + "\n").encode() for name, lines in files.items()}


class DemoUploadError(RuntimeError):
    """The demo corpus could not be uploaded; the message names the S3 location and what to check."""


def upload_corpus(s3_client, bucket: str, prefix: str, num_documents: int) -> int:
    """Create the bucket if needed and upload the corpus under prefix; returns the object count."""
    existing = {b["Name"] for b in s3_client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        s3_client.create_bucket(Bucket=bucket)
    files = demo_files(num_documents)
    for name, body in files.items():
        key = f"{prefix}/{name}" if prefix else name
        s3_client.put_object(Bucket=bucket, Key=key, Body=body)
    log.info("uploaded %d demo files (%d documents) to s3://%s/%s", len(files), num_documents, bucket, prefix)
    return len(files)


def upload_demo_data(data, num_documents: int) -> int:
    """The demo corpus to data.s3_uri (local.upload_demo_data), with an error that says what to check."""
    try:
        return upload_corpus(s3_client(data.s3_endpoint_url), data.bucket, data.prefix,
                             num_documents)
    except (ClientError, BotoCoreError) as err:
        raise DemoUploadError(f"uploading the demo corpus (local.upload_demo_data) failed: "
                              f"{s3_error(err, data.s3_uri)}") from err
