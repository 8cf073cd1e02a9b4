"""The resilient-train pipeline: prepare → fingerprint → stage → tokenize × N → collect (all three cached) →
record → train → validate → evaluate, inside an exit handler that always finalizes the run.

Parameters map onto the config tree: ``config_json`` is a whole config as one line of JSON (by default
the one the pipeline was built from; one line because KFP copies defaults into the compiled file's header
comment, where a multi-line value breaks the YAML) and ``overrides`` a list of ``section.key=value``
strings applied on top — the same syntax as the CLI, so a recurring run changes one setting without
restating the rest.

Caching: only the stage, tokenize and collect tasks are cached, keyed by the fingerprint of the S3 prefix's
listing (an unchanged dataset is not staged or tokenized twice); every other task runs each time. The stage
task plans ``data.tokenize_tasks`` groups of files; a ``dsl.ParallelFor`` tokenizes each into a shard and a
``dsl.Collected`` task lists them for the trainer. With ``kubernetes.enabled`` each task also
gets its cluster settings through kfp-kubernetes: the FSx PVC, the MLflow credentials Secret, resources,
timeouts, and retries with backoff for the stage and the TrainJob launcher.
"""

from kfp import dsl, kubernetes

from components.kfp_components import make_components
from trainer.config import Config

PIPELINE_NAME = "resilient-train"
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
# (cpu, memory) requests per task on the cluster. No step loads the model: validate streams the checkpoint a tensor
# at a time on a few threads; the evaluation and the export run on the training's GPUs, the gate only decides.
_RESOURCES = {"light": ("500m", "1Gi"), "stage": ("4", "16Gi"), "launcher": ("500m", "2Gi"), "validate": ("4", "8Gi"),
              "gate": ("1", "2Gi")}
# What the KFP UI (and the local console) calls each task; the keys are KFP's task names.
DISPLAY_NAMES = {"prepare-run": "prepare", "fingerprint-data": "fingerprint", "stage-data": "stage",
                 "tokenize-shard": "tokenize", "collect-shards": "collect shards", "record-stage": "record stage", "train-model": "train", "validate-checkpoint": "validate",
                 "evaluate-model": "evaluate", "finalize-run": "finalize"}


def build_pipeline(default_config: Config):
    """A pipeline function whose config_json parameter defaults to default_config."""
    default_json = default_config.to_json()
    k8s = default_config.kubernetes
    c = make_components(k8s.pipeline_image)

    def on_cluster(task, kind: str, timeout_seconds: int, retries: int = 0):
        """The task's display name and, with kubernetes.enabled, its cluster settings."""
        task.set_display_name(DISPLAY_NAMES[task.name])
        if not k8s.enabled:
            return task
        cpu, memory = _RESOURCES[kind]
        task.set_cpu_request(cpu).set_memory_request(memory).set_memory_limit(memory)
        kubernetes.mount_pvc(task, pvc_name=k8s.fsx_pvc, mount_path=str(default_config.fsx_root))
        if k8s.mlflow_secret:
            kubernetes.use_secret_as_env(task, secret_name=k8s.mlflow_secret, optional=True,
                                         secret_key_to_env={key: key for key in MLFLOW_SECRET_KEYS})
        kubernetes.set_timeout(task, timeout_seconds)
        if retries:
            task.set_retry(num_retries=retries, backoff_duration="60s", backoff_factor=2.0, backoff_max_duration="900s")
        return task

    @dsl.pipeline(name=PIPELINE_NAME, description="Stage data, train with FSDP2 + NVRx, validate, evaluate.")
    def resilient_train(config_json: str = default_json, overrides: list = []):  # noqa: B006 - KFP default
        common = dict(config_json=config_json, overrides=overrides, kfp_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        finalize = on_cluster(c.finalize_run(**common), "light", 1800)
        finalize.set_caching_options(False)
        with dsl.ExitHandler(finalize, name="run"):
            prepare = on_cluster(c.prepare_run(**common), "light", 1800)
            fingerprint = on_cluster(c.fingerprint_data(config_json=config_json, overrides=overrides).after(prepare),
                                     "light", 1800)
            # Only the fingerprint task's outputs reach the stage task: its cache key holds no per-run value.
            stage = on_cluster(c.stage_data(stage_config=fingerprint.outputs["stage_config"],
                                            data_fingerprint=fingerprint.outputs["fingerprint"]),
                               "stage", 6 * 3600, retries=k8s.step_retries)
            # One tokenize task per group of whole files (data.tokenize_tasks), cached like the stage task.
            with dsl.ParallelFor(stage.outputs["Output"], name="tokenize") as group:
                tokenize = on_cluster(c.tokenize_shard(group=group), "stage", 6 * 3600, retries=k8s.step_retries)
            collect = on_cluster(c.collect_shards(stage_config=fingerprint.outputs["stage_config"],
                                                  data_fingerprint=fingerprint.outputs["fingerprint"],
                                                  shards=dsl.Collected(tokenize.output), staged=stage.outputs["staged"]),
                                 "light", 1800)
            for task in (stage, tokenize, collect):
                task.set_caching_options(True)
            record = on_cluster(c.record_stage(**common, dataset=collect.outputs["dataset"]), "light", 1800)
            train = on_cluster(c.train_model(**common, data_dir=record.output), "launcher",
                               default_config.training.timeout_seconds + 3600, retries=k8s.step_retries)
            validate = on_cluster(c.validate_checkpoint(**common, checkpoint=train.outputs["Output"]), "validate",
                                  4 * 3600)
            evaluate = on_cluster(c.evaluate_model(**common, checkpoint=validate.outputs["Output"]), "gate",
                                  int(default_config.eval.promotion_wait_seconds) + 3600)
            for task in (prepare, fingerprint, record, train, validate, evaluate):
                task.set_caching_options(False)

    return resilient_train
