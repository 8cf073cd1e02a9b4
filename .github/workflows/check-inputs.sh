#!/usr/bin/env bash
# Validates what triggers hand the workflow (workflow_dispatch inputs, repository_dispatch payloads) before
# any step uses it. Values arrive as environment variables; this script never evaluates them.
set -euo pipefail

if [ -n "${CONFIG:-}" ]; then
  if ! [[ "$CONFIG" =~ ^pipelines/configs/[A-Za-z0-9_.-]+\.ya?ml$ ]] || [[ "$CONFIG" == *..* ]]; then
    echo "::error::config '$CONFIG' must be a YAML file directly in pipelines/configs/" >&2
    exit 1
  fi
  if [ ! -f "$CONFIG" ]; then
    echo "::error::config '$CONFIG' does not exist in this commit" >&2
    exit 1
  fi
fi
# Submitting needs a config filled in for the cluster: the shipped ones carry placeholders.
if [ "${REQUIRE_CLUSTER_VALUES:-0}" = "1" ]; then
  for placeholder in "s3://my-training-data" "fs-0123456789abcdef0"; do
    if grep -qF "$placeholder" "$CONFIG"; then
      echo "::error::config '$CONFIG' still holds the placeholder '$placeholder': fill in the cluster's bucket and FSx id" >&2
      exit 1
    fi
  done
fi
if [ -n "${DATA_VERSION:-}" ] && ! [[ "$DATA_VERSION" =~ ^[A-Za-z0-9._-]{1,64}$ ]]; then
  echo "::error::client_payload.data_version must be 1-64 letters, digits, '.', '_' or '-'" >&2
  exit 1
fi
echo "inputs ok: config=${CONFIG:-} data_version=${DATA_VERSION:-}"
