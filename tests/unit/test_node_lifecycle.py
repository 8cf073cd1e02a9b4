"""trainer.launch.node_lifecycle: one table says what becomes of a node whose launcher ended, for the local runner and
for the EKS runtime's podFailurePolicy alike."""

import subprocess
import sys

import pytest
import yaml

from localcluster.network import LoopbackNetwork
from localcluster.nodes import node_command
from tests.kube import MANIFESTS
from trainer.env import CRASH_LOOP_EXIT_CODE, REPLACEMENT_TIMEOUT_EXIT_CODE
from trainer.launch.launcher import external_store, is_rendezvous_timeout
from trainer.launch.node_lifecycle import Verdict, pod_failure_policy, verdict


def test_every_exit_of_a_node_has_one_verdict():
    assert verdict(0) is Verdict.FINISHED
    assert verdict(CRASH_LOOP_EXIT_CODE) is Verdict.FAIL_JOB
    assert verdict(REPLACEMENT_TIMEOUT_EXIT_CODE) is Verdict.RESTART_JOB
    for lost in (1, 2, 137, 143, -9, -15):  # an error, SIGKILL (as a code and as a signal), SIGTERM
        assert verdict(lost) is Verdict.REPLACE_NODE


def test_the_runtime_manifest_applies_the_same_table():
    runtime = yaml.safe_load((MANIFESTS / "base" / "trainer" / "clustertrainingruntime.yaml").read_text())
    [node] = [job for job in runtime["spec"]["template"]["spec"]["replicatedJobs"] if job["name"] == "node"]
    assert node["template"]["spec"]["podFailurePolicy"] == pod_failure_policy()


class RendezvousTimeoutError(Exception):
    """Stands for torch elastic's (matched by name: torch's and NVRx's copy each define one)."""


def test_a_rendezvous_timeout_is_recognised_through_ft_launchers_exit():
    """ft_launcher 0.4.1 (launcher.py main) turns any exception into sys.exit(1) inside its handler."""
    try:
        try:
            raise RendezvousTimeoutError()
        except Exception:
            sys.exit(1)
    except SystemExit as err:
        assert is_rendezvous_timeout(err)
    assert not is_rendezvous_timeout(SystemExit(1))
    assert not is_rendezvous_timeout(None)


def test_a_launcher_reports_to_the_store_only_when_no_node_hosts_it():
    assert external_store(["--rdzv-endpoint=h:29400", "--rdzv-conf=join_timeout=5,is_host=false"]) == "h:29400"
    assert external_store(["--rdzv-endpoint=h:29400", "--rdzv-conf=join_timeout=5"]) is None
    assert external_store(["--standalone"]) is None


def test_each_local_node_has_its_own_memory_and_a_stable_address():
    command = ["python", "-m", "trainer.launcher", "--node-store=/m/run", "ft_launcher", "--nnodes=3",
               "--nproc-per-node=2", "-m", "trainer"]
    assert node_command(command, 2, LoopbackNetwork().start_node(2)[1]) == [
                                        "python", "-m", "trainer.launcher", "--node-store=/m/run/node-2",
                                        "ft_launcher", "--nnodes=3", "--local-addr=127.0.0.3", "--nproc-per-node=2",
                                        "-m", "trainer"]


def test_the_rendezvous_store_refuses_a_missing_node_count():
    proc = subprocess.run([sys.executable, "-m", "trainer.rendezvous_store", "--port", "0"], capture_output=True,
                          text=True, env={"PATH": "/usr/bin"}, timeout=60)
    assert proc.returncode == 2 and "RESILIENT_TRAIN_RENDEZVOUS_NODES" in proc.stderr


@pytest.mark.parametrize("nodes", [1, 2])
def test_the_rendezvous_store_exits_once_every_node_finished(nodes):
    from trainer.launch.rendezvous_store import FINISHED_KEY, READY_LINE, connect

    store = subprocess.Popen([sys.executable, "-m", "trainer.rendezvous_store", "--host", "127.0.0.1", "--port", "0",
                              "--nodes", str(nodes)], stdout=subprocess.PIPE, text=True)
    try:
        line = store.stdout.readline()
        assert line.startswith(READY_LINE)
        client = connect("127.0.0.1", int(line.split()[-1]))
        for _ in range(nodes - 1):
            client.add(FINISHED_KEY, 1)
        with pytest.raises(subprocess.TimeoutExpired):
            store.wait(timeout=2)  # one node still training
        client.add(FINISHED_KEY, 1)
        assert store.wait(timeout=30) == 0
    finally:
        store.kill()
        store.wait()


class FakeNvml:
    """NVML's calls the check makes, answering as a node with `answering` of its GPUs working."""

    def __init__(self, count: int, broken: set[int] = frozenset()):
        self.count, self.broken = count, broken

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetMemoryInfo(self, handle):
        if handle in self.broken:
            raise RuntimeError("GPU is lost")  # pynvml's NVMLError_GpuIsLost, say
        return object()


def test_a_node_joins_only_with_every_gpu_and_efa_device():
    from trainer.resilience.health import node_problems

    eight = [f"/dev/infiniband/uverbs{i}" for i in range(32)]
    assert node_problems(8, 32, nvml=FakeNvml(8), efa_devices=eight) == []
    assert node_problems(8, 32, nvml=FakeNvml(7), efa_devices=eight) == ["7 GPUs answer NVML, 8 expected"]
    [lost] = node_problems(8, 32, nvml=FakeNvml(8, {3}), efa_devices=eight)
    assert lost.startswith("GPU 3 does not answer NVML")
    [efa] = node_problems(8, 32, nvml=FakeNvml(8), efa_devices=eight[:16])
    assert efa.startswith("16 EFA devices") and "vpc.amazonaws.com/efa" in efa
    assert node_problems(0, 0) == []  # a CPU node: nothing to check


def test_the_launcher_refuses_an_unfit_node_before_it_joins():
    """On this machine there is no NVIDIA driver: a launcher told to expect GPUs exits 44 at once, which the
    runtime treats as a lost node (replaced), not as a crash loop."""
    from trainer.env import NODE_UNHEALTHY_EXIT_CODE

    proc = subprocess.run([sys.executable, "-m", "trainer.launcher", "--check-node=8,32", "torchrun", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == NODE_UNHEALTHY_EXIT_CODE, proc.stderr
    assert "is not fit to train" in proc.stderr and "8 GPUs expected" in proc.stderr
    assert verdict(NODE_UNHEALTHY_EXIT_CODE) is Verdict.REPLACE_NODE
    bad = subprocess.run([sys.executable, "-m", "trainer.launcher", "--check-node=eight", "torchrun", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--check-node= takes GPUS,EFA" in bad.stderr


def test_a_replacement_evicts_its_predecessor_from_the_rendezvous_at_once(monkeypatch):
    """NVRx 0.4.1's rendezvous starts a new round only once every participant of the last one has left; a dead one
    leaves when it has missed 3 keep-alives of 5 s (hard-coded in FtRendezvousHandler.from_backend). Measured
    here: a replacement waited ~14 s of its 15 s downtime for that. A participant with the replacement's
    address and another pid is its predecessor (one launcher per address), and is dropped at the first sync."""
    import datetime
    import os

    rendezvous = pytest.importorskip("nvidia_resiliency_ext.fault_tolerance._ft_rendezvous")
    from trainer.resilience import nvrx_compat

    holder_class = rendezvous._BackendRendezvousStateHolder
    monkeypatch.setattr(holder_class, "_sanitize", holder_class._sanitize)  # restored after the test
    now = datetime.datetime.utcnow()
    predecessor = rendezvous._NodeDesc("127.0.0.2", 4242, 0)
    itself = rendezvous._NodeDesc("127.0.0.2", os.getpid(), 0)
    survivor = rendezvous._NodeDesc("127.0.0.1", 4343, 0)

    def synced_view():
        holder = object.__new__(holder_class)
        holder._state = rendezvous._RendezvousState()
        holder._state.complete = True
        holder._state.participants = {predecessor: 1}
        holder._state.last_heartbeats = {predecessor: now, itself: now, survivor: now}
        holder._settings = rendezvous.RendezvousSettings(
            "run", 2, 2, rendezvous.RendezvousTimeout(), keep_alive_interval=datetime.timedelta(seconds=5),
            keep_alive_max_attempt=3)
        holder._dead_nodes = []
        return holder

    unpatched = synced_view()
    unpatched._sanitize()
    assert predecessor in unpatched._state.participants  # alive for 15 s more, as far as NVRx can tell
    assert nvrx_compat.evict_predecessors_from_rendezvous("127.0.0.2") is True
    patched = synced_view()
    patched._sanitize()
    assert patched._state.participants == {} and set(patched._state.last_heartbeats) == {itself, survivor}
    assert patched._state.complete is False and patched._state.round == 1  # the next round can start


def test_a_local_rendezvous_store_goes_with_the_runner_that_started_it():
    """Seen: a store outlived a run whose runner was killed. Started with --die-with-parent (as the local runner
    starts it), it exits when its parent does."""
    import psutil

    runner = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-m', 'trainer.rendezvous_store', "
        "'--host', '127.0.0.1', '--port', '0', '--nodes', '1', '--die-with-parent'], stdout=subprocess.PIPE, "
        "text=True); p.stdout.readline(); print(p.pid, flush=True); time.sleep(600)")], stdout=subprocess.PIPE,
        text=True)
    store = psutil.Process(int(runner.stdout.readline()))
    runner.kill()
    runner.wait()
    gone, alive = psutil.wait_procs([store], timeout=10)
    assert not alive


def _first_matching_rule(policy: dict, exit_code: int) -> dict | None:
    """The Job controller's podFailurePolicy for a pod whose container `node` exited with this code: rules in
    order, the first whose onExitCodes matches acts (Kubernetes API, batch/v1 PodFailurePolicyRule); none: the
    failure counts against the index's backoffLimitPerIndex and the pod is recreated with the same index."""
    for rule in policy["rules"]:
        codes = rule.get("onExitCodes")
        if codes and codes["containerName"] == "node" and (
                (exit_code in codes["values"]) == (codes["operator"] == "In")):
            return rule
    return None


def test_a_groups_missing_replacement_restarts_that_group_only():
    """With replica groups a survivor's rendezvous timeout is the group's, not the job's: 45 (not 43). Locally the
    runner restarts that group's nodes; on EKS no FailJob rule matches 45, so each of the group's pods is recreated
    by index and the JobSet, which acts only on a failed Job, leaves the other groups' pods running."""
    from trainer.env import GROUP_RESTART_EXIT_CODE

    assert verdict(GROUP_RESTART_EXIT_CODE) is Verdict.RESTART_GROUP
    assert _first_matching_rule(pod_failure_policy(), GROUP_RESTART_EXIT_CODE) is None
    assert _first_matching_rule(pod_failure_policy(), REPLACEMENT_TIMEOUT_EXIT_CODE)["action"] == "FailJob"


def test_a_trainjob_pod_finds_its_group_and_its_rank_in_it():
    from trainer.launch.groups import join_replica_group

    args = ["--rdzv-backend=c10d", "--rdzv-id=rt-x-a0", "--nnodes=4", "--nproc-per-node=8"]
    env, rewritten = join_replica_group({"PET_NODE_RANK": "5", "PET_NNODES": "8"}, args, groups=2)
    assert env == {"RESILIENT_TRAIN_REPLICA_GROUP": "1", "RESILIENT_TRAIN_NODE_INDEX": "5", "PET_NODE_RANK": "1",
                   "PET_NNODES": "4"}
    assert "--rdzv-id=rt-x-a0-group-1" in rewritten and "--nnodes=4" in rewritten
    assert join_replica_group({"PET_NODE_RANK": "5", "PET_NNODES": "8"}, args, groups=1) == ({}, args)
    placed = {"PET_NODE_RANK": "0", "PET_NNODES": "1", "RESILIENT_TRAIN_REPLICA_GROUP": "1"}  # the local runner's
    assert join_replica_group(placed, args, groups=2) == ({}, args)
    with pytest.raises(ValueError, match="do not split into 3 replica groups"):
        join_replica_group({"PET_NODE_RANK": "0", "PET_NNODES": "8"}, args, groups=3)


def test_the_runtime_serves_the_lighthouse_to_the_trainers_only():
    from trainer.launch.lighthouse import LIGHTHOUSE_JOB, LIGHTHOUSE_PORT

    runtime = yaml.safe_load((MANIFESTS / "base" / "trainer" / "clustertrainingruntime.yaml").read_text())
    spec = runtime["spec"]["template"]["spec"]
    [job] = [j for j in spec["replicatedJobs"] if j["name"] == LIGHTHOUSE_JOB]
    pod = job["template"]["spec"]["template"]
    [container] = pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "trainer.lighthouse"]
    assert container["ports"] == [{"name": "lighthouse", "containerPort": LIGHTHOUSE_PORT}]
    assert spec["successPolicy"]["targetReplicatedJobs"] == ["node"]  # done when the nodes are, not the lighthouse
    policy = yaml.safe_load((MANIFESTS / "base" / "trainer" / "lighthouse-networkpolicy.yaml").read_text())
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": pod["metadata"]["labels"][
        "app.kubernetes.io/name"]}
    [rule] = policy["spec"]["ingress"]
    [node] = [j for j in spec["replicatedJobs"] if j["name"] == "node"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": node["template"]["spec"][
        "template"]["metadata"]["labels"]["app.kubernetes.io/name"]}}}]
    assert rule["ports"] == [{"port": LIGHTHOUSE_PORT, "protocol": "TCP"}]
