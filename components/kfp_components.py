"""The pipeline's KFP components: each step's thin wrapper (components/<step>/component.py) built as a
component that runs in the pipeline image.

The wrappers are plain functions whose bodies import what they need (KFP ships each body to its own
process, or container); their logic lives beside them in step.py, testable without KFP. On EKS the image is
kubernetes.pipeline_image; the local runner executes them in this virtual environment.
"""

from types import SimpleNamespace

from kfp import dsl

from components.evaluate.component import evaluate_model
from components.finalize.component import finalize_run
from components.prepare.component import prepare_run
from components.stage.component import collect_shards, fingerprint_data, record_stage, stage_data, tokenize_shard
from components.train.component import train_model
from components.validate.component import validate_checkpoint

WRAPPERS = (prepare_run, fingerprint_data, stage_data, tokenize_shard, collect_shards, record_stage, train_model,
            validate_checkpoint, evaluate_model, finalize_run)


def make_components(image: str) -> SimpleNamespace:
    """The KFP components, running in `image`. install_kfp_package=False: the image has kfp (and it saves
    ~0.6 s per step locally)."""
    return SimpleNamespace(**{f.__name__: dsl.component(f, base_image=image, install_kfp_package=False)
                              for f in WRAPPERS})
