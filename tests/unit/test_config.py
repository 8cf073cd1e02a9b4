import pytest
import yaml

from trainer.config import CONFIG_DIR, Config, ConfigError, load_config, parse_overrides


def test_defaults_are_valid_and_every_field_has_a_docstring():
    import ast
    import inspect

    import trainer.config as module

    cfg = Config()
    assert cfg.training.num_steps > 0
    tree = ast.parse(inspect.getsource(module))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and node.name != "Config":
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    following = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant), (
                        f"{node.name}.{stmt.target.id} has no docstring")


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_bundled_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_overrides_apply_on_top_of_yaml_with_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"training": {"num_steps": 50, "lr": 0.01}}))
    cfg = load_config(path, ["--training.num_steps=7", "training.grad_clip=0.5", "--local.s3_server=false",
                             "--run.trigger=ci"])
    assert cfg.training.num_steps == 7
    assert cfg.training.lr == 0.01
    assert cfg.training.grad_clip == 0.5
    assert cfg.local.s3_server is False
    assert cfg.run.trigger == "ci"


def test_bundled_name_resolves_to_configs_dir():
    assert load_config("local").run.experiment == "resilient-train-local"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--training.num_stepz=3"], "unknown key 'training.num_stepz'"),
        (["--trainin.num_steps=3"], "unknown section 'trainin'"),
        (["--training.num_steps=abc"], "training.num_steps: expected an integer, got 'abc'"),
        (["--training.lr=fast"], "training.lr: expected a number"),
        (["--local.s3_server=maybe"], "local.s3_server: expected true or false"),
        (["--run.trigger=cron"], "run.trigger: 'cron' is not one of"),
        (["--model.preset=huge"], "model.preset: 'huge' is not one of"),
        (["--training.num_steps=0"], "training.num_steps: must be >= 1"),
        (["--training.warmup_steps=-1"], "training.warmup_steps: must be >= 0"),
        (["--training.grad_clip=-1"], "training.grad_clip: must be >= 0"),
        (["--data.s3_uri=bucket/prefix"], "data.s3_uri: 'bucket/prefix' must look like s3://bucket/prefix"),
        (["--data.stage_mode=dra"], "data.fsx_file_system_id: must be an FSx file system id"),
        (["--data.dra_auto_import=NEW,MOVED"], "data.dra_auto_import: must list NEW, CHANGED and/or DELETED"),
        (["--checkpoint.memory_interval_steps=-1"], "checkpoint.memory_interval_steps: must be >= 0"),
        (["--checkpoint.memory_dir=shm"], "checkpoint.memory_dir: 'shm' must be an absolute path"),
        (["--checkpoint.s3_uri=s3://Bad_Bucket/x"], "checkpoint.s3_uri: bucket 'Bad_Bucket' is not a valid"),
        (["--checkpoint.s3_every=0"], "checkpoint.s3_every: must be >= 1"),
        (["--run.run_id=Bad_Name"], "run.run_id"),
        (["training.num_steps"], "must look like --section.key=value"),
        # replica groups: each rule names its field
        (["--training.num_nodes=3", "--training.replica_groups=2"], "training.replica_groups: must divide"),
        (["--training.num_nodes=2", "--training.replica_groups=2", "--resilience.min_replica_groups=3"],
         "resilience.min_replica_groups: must be in [1, training.replica_groups=2]"),
        (["--training.num_nodes=2", "--training.replica_groups=2", "--resilience.heartbeat_timeout=20"],
         "resilience.quorum_timeout_seconds: must be below resilience.heartbeat_timeout=20"),
        (["--training.num_nodes=2", "--training.replica_groups=2", "--resilience.replica_timeout_seconds=30"],
         "resilience.replica_timeout_seconds: twice it must be below resilience.heartbeat_timeout=60"),
        (["--training.num_nodes=2", "--training.replica_groups=2", "--local.node_loss=restart_job"],
         "local.node_loss: restart_job restarts every group"),
        (["--faults.schedule=group_loss@5:group=1"], "could never fire: the job has one replica group"),
        (["--training.num_nodes=2", "--training.replica_groups=2", "--faults.schedule=group_loss@5:group=2"],
         "group 2 does not exist"),
        (["--faults.schedule=group_loss@5:rank=1"], "group_loss@STEP:group=G[:permanent]"),
        (["--faults.schedule=sigkill@5:group=1"], ":group= is taken only by group_loss and bitflip, :permanent only by group_loss"),
        # throughput (issue 44): native HSDP and torchft's groups are two ways to replicate: one at a time
        (["--training.num_nodes=2", "--training.replica_groups=2", "--training.data_parallel_replicate_degree=2"],
         "training.data_parallel_replicate_degree: =2 and training.replica_groups=2 both make replicas"),
        (["--training.nproc_per_node=2", "--training.data_parallel_replicate_degree=3"],
         "training.data_parallel_replicate_degree: =3 must divide the job's 2 ranks"),
        (["--training.activation_checkpointing=some"], "training.activation_checkpointing: 'some' is not one of"),
        (["--training.selective_ac=0"], "training.selective_ac: must be op or a layer interval >= 1"),
        (["--training.mixed_precision_param=fp8"], "training.mixed_precision_param: 'fp8' is not one of"),
        (["--optimizer.implementation=apex"], "optimizer.implementation: 'apex' is not one of"),
        (["--model.activation_checkpointing=true"],
         "model.activation_checkpointing moved to training.activation_checkpointing (none, full or selective)"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_yaml_errors_name_the_file_and_key(tmp_path):
    bad_key = tmp_path / "bad.yaml"
    bad_key.write_text("training:\n  num_stepz: 3\n")
    with pytest.raises(ConfigError, match="unknown key 'training.num_stepz'"):
        load_config(bad_key)
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml: expected a mapping"):
        load_config(not_mapping)
    with pytest.raises(ConfigError, match="config file 'missing.yaml' not found"):
        load_config("missing.yaml")


def test_yaml_bool_is_not_an_integer(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("training:\n  num_steps: true\n")
    with pytest.raises(ConfigError, match="training.num_steps: expected an integer"):
        load_config(path)


def test_round_trip_through_yaml_is_lossless():
    from trainer.config import config_from_yaml_text

    cfg = load_config("local", ["--run.run_id=abc", "--training.lr=0.02"])
    assert config_from_yaml_text(cfg.to_yaml()) == cfg


def test_parse_overrides_keeps_equals_in_values():
    assert parse_overrides(["--data.s3_uri=s3://b/k=v"]) == {"data": {"s3_uri": "s3://b/k=v"}}


def test_config_hash_ignores_run_identity_but_not_training():
    base = load_config(None, ["--run.run_id=a"])
    assert base.config_hash() == load_config(None, ["--run.run_id=b", "--run.work_dir=/x"]).config_hash()
    assert base.config_hash() != load_config(None, ["--training.lr=0.5"]).config_hash()


def test_derived_paths(tmp_path):
    cfg = load_config(None, [f"--run.work_dir={tmp_path}", "--run.run_id=r1"])
    assert cfg.fsx_root == tmp_path / "fsx"
    assert cfg.run_dir == tmp_path / "fsx" / "runs" / "r1"
    assert cfg.checkpoint_dir == cfg.run_dir / "checkpoints"
    assert cfg.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert cfg.data.bucket == "resilient-train-data" and cfg.data.prefix == "datasets/demo"


def test_fault_schedule_grammar():
    from trainer.config.drills import Fault, parse_schedule, random_schedule

    assert parse_schedule("sigkill@120:rank=1, hang@t=30s, exception@5") == [
        Fault("sigkill", 120, None, 1), Fault("hang", None, 30.0, 0), Fault("exception", 5, None, 0)]
    with pytest.raises(ConfigError, match=r"faults.schedule: 'sigkil@3' must look like|'sigkil' in"):
        load_config(None, ["--faults.schedule=sigkil@3"])
    with pytest.raises(ConfigError, match=r"faults.schedule: 'sigkill@soon' must look like TYPE@STEP"):
        load_config(None, ["--faults.schedule=sigkill@soon"])
    with pytest.raises(ConfigError, match="faults.random_types: 'meteor'"):
        load_config(None, ["--faults.random_types=exception,meteor"])
    schedule = random_schedule(1000, 100.0, ["exception", "sigkill"], world_size=2, seed=3)
    assert schedule == random_schedule(1000, 100.0, ["exception", "sigkill"], world_size=2, seed=3)
    assert 4 <= len(schedule) <= 20 and all(1 <= f.step < 1000 and f.rank in (0, 1) for f in schedule)


@pytest.mark.parametrize("uri, message", [
    ("s3://ab/data", "not a valid S3 bucket name"),
    ("s3://My_Bucket/data", "not a valid S3 bucket name"),
    ("s3://" + "a" * 64 + "/data", "not a valid S3 bucket name"),
    ("s3://bucket-/data", "not a valid S3 bucket name"),
    ("s3://192.168.1.1/data", "not an IP address"),
    ("s3://my..bucket/data", "no '..'"),
    ("s3://xn--bucket/data", "reserved prefix"),
    ("s3://bucket/a//b", "empty segment"),
    ("http://bucket/data", "must look like s3://bucket/prefix"),
])
def test_s3_uris_follow_s3s_bucket_naming_rules(uri, message):
    """Amazon S3 User Guide, "General purpose bucket naming rules"."""
    with pytest.raises(ConfigError, match=f"data.s3_uri: .*{message}"):
        load_config(None, [f"--data.s3_uri={uri}"])


def test_valid_s3_uris_pass():
    for uri in ("s3://my-bucket.v2/data/set", "s3://abc", "s3://bucket/prefix/"):
        assert load_config(None, [f"--data.s3_uri={uri}"]).data.s3_uri == uri


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "NaN", "1e999"])
def test_no_float_field_takes_inf_or_nan(value):
    with pytest.raises(ConfigError, match="training.lr: must be a finite number"):
        load_config(None, [f"--training.lr={value}"])
    with pytest.raises(ConfigError, match="resilience.soft_timeout: must be a finite number"):
        load_config(None, [f"--resilience.soft_timeout={value}"])


def test_inf_from_yaml_and_from_code_is_refused(tmp_path):
    import dataclasses

    path = tmp_path / "c.yaml"
    path.write_text("eval:\n  promotion_threshold: .nan\n")
    with pytest.raises(ConfigError, match="eval.promotion_threshold: must be a finite number"):
        load_config(path)
    with pytest.raises(ConfigError, match="faults.slow_seconds: must be a finite number"):
        dataclasses.replace(Config(), faults=dataclasses.replace(Config().faults, slow_seconds=float("inf")))


def test_a_one_group_job_keeps_its_timeouts_free_of_torchft_rules():
    """R = 1 runs no torchft: its quorum timeouts do not constrain the heartbeat (tests run with 8 s)."""
    cfg = load_config(None, ["--resilience.heartbeat_timeout=8"])
    assert cfg.training.replica_groups == 1 and cfg.resilience.min_groups(1) == 1


def test_group_loss_drills_parse_with_their_group_and_permanence():
    from trainer.config.drills import parse_schedule

    lost, gone = parse_schedule("group_loss@5:group=1, group_loss@9:group=0:permanent")
    assert (lost.group, lost.permanent, lost.key) == (1, False, "group_loss@5:group=1")
    assert (gone.group, gone.permanent, gone.key) == (0, True, "group_loss@9:group=0:permanent")
    cfg = load_config(None, ["--training.num_nodes=4", "--training.replica_groups=2",
                             "--resilience.min_replica_groups=1", "--faults.schedule=group_loss@9:group=1:permanent"])
    assert cfg.resilience.min_groups(2) == 1


def test_a_config_extends_another_and_takes_its_clusters_values_from_one_env_file(tmp_path):
    (tmp_path / "overlay").mkdir()
    (tmp_path / "overlay" / "cluster-values.env").write_text(
        "# the overlay's values\nIMAGE=registry/trainer@sha256:abc\n\nGPU_INSTANCE_TYPE=p5.48xlarge\nBUCKET=art\n")
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "training": {"num_steps": 100, "lr": 0.5}, "eval": {"export_uri": "s3://${BUCKET}/exports"},
        "kubernetes": {"image": "${IMAGE}", "node_selector": "node.kubernetes.io/instance-type=${GPU_INSTANCE_TYPE}"}}))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"extends": "base.yaml",
                                                        "cluster_values": "overlay/cluster-values.env",
                                                        "training": {"num_steps": 7}}))
    cfg = load_config(tmp_path / "job.yaml", ["--training.warmup_steps=3"])
    assert (cfg.training.num_steps, cfg.training.lr, cfg.training.warmup_steps) == (7, 0.5, 3)  # section by section
    assert cfg.kubernetes.image == "registry/trainer@sha256:abc"
    assert cfg.kubernetes.node_selector == "node.kubernetes.io/instance-type=p5.48xlarge"
    assert cfg.eval.export_uri == "s3://art/exports"
    assert "${" not in cfg.to_yaml()  # what the pipeline and the run folder carry: the values


@pytest.mark.parametrize("files, message", [
    ({"job.yaml": {"cluster_values": "values.env", "kubernetes": {"image": "${IMAGE}"}}, "values.env": "OTHER=1\n"},
     r"kubernetes.image: \$\{IMAGE\} is not set in .*values.env \(cluster_values\): add IMAGE=... there"),
    ({"job.yaml": {"cluster_values": "missing.env"}},
     r"job.yaml: cluster_values: .*missing.env not found"),
    ({"job.yaml": {"cluster_values": "values.env"}, "values.env": "IMAGE\n"},
     r"values.env:1: expected KEY=value, got 'IMAGE'"),
    ({"job.yaml": {"extends": "other.yaml"}, "other.yaml": {"extends": "job.yaml"}}, r"extends itself"),
    ({"job.yaml": {"extends": "nowhere.yaml"}}, r"config file 'nowhere.yaml' not found"),
])
def test_a_broken_extends_or_cluster_values_names_the_file(tmp_path, files, message):
    for name, content in files.items():
        (tmp_path / name).write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "job.yaml")


def test_the_eks_configs_carry_their_overlays_values():
    """One source: each EKS config's cluster values are its overlay's cluster-values.env (the manifests' source)."""
    for name in ("dev", "prod", "cpt"):
        values = dict(line.split("=", 1) for line in (CONFIG_DIR.parents[1] / "manifests" / "overlays" / name /
                                                      "cluster-values.env").read_text().splitlines()
                      if line and not line.startswith("#"))
        cfg = load_config(f"eks-{name}")
        assert (cfg.kubernetes.image, cfg.kubernetes.pipeline_image) == (values["IMAGE"], values["PIPELINE_IMAGE"])
        assert cfg.kubernetes.node_selector_map == {"node.kubernetes.io/instance-type": values["GPU_INSTANCE_TYPE"]}
        assert cfg.eval.export_uri == f"s3://{values['ARTIFACT_BUCKET']}/exports"


def test_a_base_config_alone_is_refused_naming_its_placeholder():
    with pytest.raises(ConfigError, match=r"data.fsx_file_system_id: \$\{FSX_FILE_SYSTEM_ID\} in .*eks-llama31-8b.yaml, "
                                          r"which names no cluster_values file"):
        load_config(CONFIG_DIR / "base" / "eks-llama31-8b.yaml")
