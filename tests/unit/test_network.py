"""local.node_network and the network drills' grammar, without making any namespace (that is
tests/integration/test_network_faults.py, as root)."""

import pytest

from localcluster import network
from trainer.config import ConfigError, load_config
from trainer.config.drills import parse_schedule


def test_without_root_netns_is_refused_with_what_to_do(monkeypatch):
    monkeypatch.setattr(network.os, "geteuid", lambda: 1000)
    problem = network.netns_problem()
    assert "local.node_network=netns" in problem and "needs root" in problem and "uid 1000" in problem
    assert "local.node_network=loopback" in problem
    with pytest.raises(network.NetworkUnavailable, match="needs root"):
        network.node_network("netns", "0123456789")


def test_a_missing_tool_names_its_debian_package(monkeypatch):
    monkeypatch.setattr(network.os, "geteuid", lambda: 0)
    monkeypatch.setattr(network.shutil, "which", lambda tool: None if tool == "ip" else "/usr/bin/" + tool)
    assert "Debian package iproute2" in network.netns_problem()


def test_loopback_stays_the_default_and_gives_each_node_a_stable_address():
    cfg = load_config("local", ["--training.num_nodes=3"])
    assert cfg.local.node_network == "loopback"
    net = network.node_network(cfg.local.node_network)
    assert [net.start_node(i)[1] for i in (0, 1, 2, 1)] == ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.2"]
    assert net.services_prefix() == []


@pytest.mark.parametrize("item, node, seconds, times", [
    ("partition@40:node=1", 1, None, None),
    ("partition@40:node=1:seconds=30", 1, 30.0, None),
    ("flap@80:node=0:times=3", 0, None, 3),
    ("partition_store@120:seconds=5", None, 5.0, None),
])
def test_the_network_drills_parse_and_keep_their_key(item, node, seconds, times):
    [fault] = parse_schedule(item)
    assert (fault.node, fault.down_seconds, fault.times, fault.step) == (node, seconds, times, int(item[item.index("@") + 1:].split(":")[0]))
    assert fault.key == item


@pytest.mark.parametrize("item", ["partition@40", "flap@80:node=0", "flap@80:node=0:times=0",
                                  "partition_store@5:node=1:seconds=3", "partition@t=30:node=1",
                                  "partition@4:node=1:rank=0", "sigkill@4:node=1", "exception@4:seconds=3"])
def test_a_malformed_network_drill_is_refused(item):
    with pytest.raises(ValueError, match="network drill|only the network drills|must look like"):
        parse_schedule(item)


def test_network_drills_need_namespaces_and_an_existing_node():
    with pytest.raises(ConfigError, match="set local.node_network=netns"):
        load_config("local", ["--training.num_nodes=2", "--faults.schedule=partition@4:node=1"])
    with pytest.raises(ConfigError, match="node 2 does not exist"):
        load_config("local", ["--training.num_nodes=2", "--local.node_network=netns",
                              "--faults.schedule=partition@4:node=2"])
    with pytest.raises(ConfigError, match="local.node_network: netns gives each node a network of its own"):
        load_config("local", ["--local.node_network=netns"])
