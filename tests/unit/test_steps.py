import pytest

from components.context import resolve_config
from trainer.config import ConfigError, load_config


def test_every_step_resolves_the_same_config_from_json_and_overrides():
    base = load_config("local").to_json()
    cfg = resolve_config(base, ["training.num_steps=9"], kfp_job_id="ABC123")
    assert cfg.training.num_steps == 9
    assert cfg.run.run_id == "abc123"  # KFP's job id, lower-cased, when no run id is set
    assert resolve_config(base, ["run.run_id=mine"], kfp_job_id="x").run.run_id == "mine"


def test_yaml_text_is_accepted_too():
    assert resolve_config(load_config("local").to_yaml(), [], "j1").model.preset == "tiny"


def test_without_run_id_or_job_id_the_field_is_named():
    with pytest.raises(ValueError, match="run.run_id"):
        resolve_config(load_config("local").to_json(), [], "")


def test_bad_override_in_a_pipeline_parameter_names_the_field():
    with pytest.raises(ConfigError, match="unknown key 'training.stepz'"):
        resolve_config(load_config("local").to_json(), ["training.stepz=1"], "j")
