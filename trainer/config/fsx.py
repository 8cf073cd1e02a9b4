"""FSx for Lustre's storage sizes and throughputs, by AWS's rules (trainer.planning.fsx sizes one for a job).

The rules (Amazon FSx API reference, CreateFileSystem StorageCapacity and LustreConfiguration
PerUnitStorageThroughput; FSx for Lustre User Guide, "Managing throughput capacity"):
- SSD storage of SCRATCH_2 and PERSISTENT_2: 1,200 GiB, 2,400 GiB, then increments of 2,400 GiB;
- PERSISTENT_2 provisions 125, 250, 500 or 1,000 MB/s per TiB of storage; SCRATCH_2 has a baseline of 200 MB/s
  per TiB (and bursts above it, which a checkpoint every interval cannot count on);
- the file system's throughput is its storage in TiB times that.
SCRATCH_2 keeps no second copy of the data: a failed server loses files, so a job's only durable checkpoint must
not live there (docs/first-run-on-eks.md: PERSISTENT_2, and checkpoint.s3_uri).
"""

from __future__ import annotations

from trainer.config.rules import ConfigError

DEPLOYMENT_TYPES = ("SCRATCH_2", "PERSISTENT_2")
PERSISTENT_2_MBPS_PER_TIB = (125, 250, 500, 1000)
SCRATCH_2_MBPS_PER_TIB = 200
FIRST_STEPS_GIB = (1200, 2400)
STEP_GIB = 2400


def valid_storage_gib(gib: int) -> bool:
    return gib in FIRST_STEPS_GIB or (gib > 0 and gib % STEP_GIB == 0)


def throughput_mbps(deployment_type: str, storage_gib: int, per_unit_mbps_per_tib: int) -> float:
    """The file system's throughput in MB/s, checked against the rules above (ConfigError naming the field)."""
    if deployment_type not in DEPLOYMENT_TYPES:
        raise ConfigError(f"kubernetes.fsx_deployment_type: {deployment_type!r} is not one of {DEPLOYMENT_TYPES}")
    if not valid_storage_gib(storage_gib):
        raise ConfigError(f"kubernetes.fsx_storage_gib: {storage_gib} GiB is not a size FSx offers (1200, 2400, "
                           "or a multiple of 2400)")
    if deployment_type == "SCRATCH_2":
        if per_unit_mbps_per_tib not in (0, SCRATCH_2_MBPS_PER_TIB):
            raise ConfigError("kubernetes.fsx_per_unit_throughput: SCRATCH_2 has no throughput tier (its baseline "
                               f"is {SCRATCH_2_MBPS_PER_TIB} MB/s/TiB): leave it 0")
        per_unit = SCRATCH_2_MBPS_PER_TIB
    else:
        if per_unit_mbps_per_tib not in PERSISTENT_2_MBPS_PER_TIB:
            raise ConfigError(f"kubernetes.fsx_per_unit_throughput: PERSISTENT_2 offers {PERSISTENT_2_MBPS_PER_TIB} "
                               f"MB/s/TiB, not {per_unit_mbps_per_tib}")
        per_unit = per_unit_mbps_per_tib
    return storage_gib / 1024 * per_unit
