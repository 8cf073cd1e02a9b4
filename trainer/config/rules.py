"""Validation rules the config sections share: the error type, the check helper, S3 URI and run id rules."""

from __future__ import annotations

import hashlib
import re

RUN_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class InputError(ValueError):
    """What the user brought cannot be used (a config field, a base model, a tokenizer, a corpus): the message
    names the field or the file and says what to do. Every command exits 2 on one, before any GPU time."""


class ConfigError(InputError):
    """A user mistake in a configuration file or override; the message names the field."""


def require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{name}: {message}")


# General purpose bucket names (Amazon S3 User Guide, "General purpose bucket naming rules"): 3-63 characters
# of lowercase letters, digits, '.' and '-', starting and ending with a letter or digit, no '..', not an IPv4
# address, none of the reserved prefixes and suffixes.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BUCKET_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def check_s3_uri(uri: str, name: str) -> None:
    """s3://bucket/prefix with a valid bucket name and no empty segment in the prefix; names the field."""
    require(uri.startswith("s3://") and len(uri) > len("s3://"), name, f"{uri!r} must look like s3://bucket/prefix")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    require(bool(_BUCKET.match(bucket)), name,
             f"bucket {bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, '.' or '-', "
             "starting and ending with a letter or digit)")
    require(".." not in bucket and not re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket)
             and not bucket.startswith(_BUCKET_RESERVED_PREFIXES) and not bucket.endswith(_BUCKET_RESERVED_SUFFIXES),
             name, f"bucket {bucket!r} is not a valid S3 bucket name (no '..', not an IP address, no reserved "
                   "prefix or suffix)")
    require("//" not in prefix.rstrip("/") and not prefix.startswith("/"), name,
             f"prefix {prefix!r} has an empty segment ('//'): S3 keys would not match the folders staged")


def is_s3_uri(value: str) -> bool:
    return value.startswith("s3://")


def staged_folder_name(uri: str) -> str:
    """The folder an S3 prefix is staged into below <fsx_root>/models: its last segment (the bucket's name for
    the bucket's root), with characters a folder name should not have replaced by '-', and 8 hex digits of the
    whole URI's hash, so that two prefixes ending alike (s3://a/x/hf, s3://b/y/hf) never share a folder. A
    trailing '/' names the same prefix."""
    normalized = uri.rstrip("/")
    bucket, _, prefix = normalized[len("s3://"):].partition("/")
    last = prefix.rsplit("/", 1)[-1] or bucket
    digest = hashlib.sha256(normalized.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9._-]', '-', last)}-{digest}"
