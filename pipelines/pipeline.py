"""The resilient-train pipeline: prepare → stage → train → validate → evaluate, with an exit handler.

Parameters map onto the config tree: ``config_json`` is a whole config as one line of JSON (by default
the one the pipeline was built from; one line because KFP copies defaults into the compiled file's header
comment, where a multi-line value breaks the YAML) and ``overrides`` a list of ``section.key=value`` strings applied on top — the same syntax
as the CLI, so a recurring run changes one setting without restating the rest.
"""


from kfp import dsl

from components.pipeline_components import (evaluate_model, finalize_run, prepare_run, stage_data, train_model,
                                            validate_checkpoint)
from trainer.config import Config

PIPELINE_NAME = "resilient-train"


def build_pipeline(default_config: Config):
    """A pipeline function whose config_json parameter defaults to default_config."""
    default_json = default_config.to_json()

    @dsl.pipeline(name=PIPELINE_NAME, description="Stage data, train with FSDP2 + NVRx, validate, evaluate.")
    def resilient_train(config_json: str = default_json, overrides: list = []):  # noqa: B006 - KFP default
        common = dict(config_json=config_json, overrides=overrides, kfp_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        finalize = finalize_run(**common).set_display_name("finalize")
        with dsl.ExitHandler(finalize, name="run"):
            prepare = prepare_run(**common).set_display_name("prepare")
            stage = stage_data(**common).after(prepare).set_display_name("stage")
            train = train_model(**common, data_dir=stage.outputs["Output"]).set_display_name("train")
            train.set_caching_options(False)
            validate = validate_checkpoint(**common, checkpoint=train.outputs["Output"]).set_display_name("validate")
            evaluate_model(**common, checkpoint=validate.outputs["Output"],
                           data_dir=stage.outputs["Output"]).set_display_name("evaluate")

    return resilient_train
