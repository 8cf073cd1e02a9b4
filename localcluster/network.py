"""The local nodes' network: loopback, or a network namespace per node so that one can be cut off.

    network = node_network(cfg, token)     # LoopbackNetwork, or NamespaceNetwork (local.node_network=netns)
    store = subprocess.Popen(network.services_prefix() + [...bind network.services_address...])
    prefix, address = network.start_node(index)   # a new incarnation of node `index`: its own namespace
    network.cut_node(index); network.restore_node(index, incarnation)   # what the drills do
    network.close()                         # every namespace, link and file of this launch gone

With namespaces (root only), every node's launcher and workers run in a namespace of their own — a host name of
their own too (rt-node-<index>, as a pod has), an address on the launch's bridge — and the rendezvous store and
the lighthouse in another (rt-services). The run folder stays shared, as FSx is on EKS. A node's replacement is
a new namespace (a new machine) with a new address and the same host name; the cut-off one it replaces keeps its
old view of the world (its hosts file is no longer updated) until its link comes back.

Names carry the launch's token, ``rt-<token>-...`` for namespaces and ``rt<token>...`` for links: the runner
holds ``/run/resilient-train-netns/<token>.lock`` while it lives, shared with a keeper process that removes
everything of the token once the runner is gone (killed included), and every start sweeps away what a token
whose lock nobody holds left behind (a keeper killed too).
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

STATE_DIR = Path("/run/resilient-train-netns")
ETC_NETNS = Path("/etc/netns")  # `ip netns exec NAME` bind-mounts /etc/netns/NAME/hosts over /etc/hosts
SUBNET = "10.77.0.0/16"  # on the launch's own bridge: no address in this machine's namespace, so launches never clash
SERVICES_ADDRESS = "10.77.1.1"
SERVICES_HOST = "rt-services"
TOKEN_CHARS = 6
_NAME = re.compile(r"^rt-(?P<token>[0-9a-f]{6})-")
_LINK = re.compile(r"^rt(?P<token>[0-9a-f]{6})[bv]")


class NetworkUnavailable(RuntimeError):
    """local.node_network=netns cannot be set up here; the message says why and what to do."""


def node_host(index: int) -> str:
    return f"rt-node-{index}"


def netns_problem() -> str | None:
    """Why namespaces cannot be made here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return ("local.node_network=netns makes network namespaces, veth pairs and a bridge, which needs root "
                f"(this process runs as uid {os.geteuid()}): run as root (sudo), or set local.node_network=loopback")
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return (f"local.node_network=netns needs `{tool}` (Debian package {package}), which is not on PATH: "
                    f"install it (`make install` does, as root), or set local.node_network=loopback")
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetworkUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()} — local.node_network=netns "
                                 "cannot set up the nodes' network here; set local.node_network=loopback")
    return result


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]


def _links() -> list[str]:
    return [line.split(":")[1].strip().split("@")[0]
            for line in _ip("-o", "link", "show", check=False).stdout.splitlines() if ":" in line]


def remove_token(token: str) -> None:
    """Everything of one launch's network: its namespaces (their veth ends with them), links and hosts files."""
    for name in _namespaces():
        match = _NAME.match(name)
        if match and match["token"] == token:
            _ip("netns", "delete", name, check=False)
            shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    for link in _links():
        match = _LINK.match(link)
        if match and match["token"] == token:
            _ip("link", "delete", link, check=False)
    for folder in ETC_NETNS.glob(f"rt-{token}-*") if ETC_NETNS.is_dir() else []:
        shutil.rmtree(folder, ignore_errors=True)


def _owner_alive(token: str) -> bool:
    lock = STATE_DIR / f"{token}.lock"
    if not lock.exists():
        return False
    with lock.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
    return False


def sweep() -> list[str]:
    """Remove what launches no longer alive left behind (a killed runner and its keeper); the tokens removed."""
    tokens = {m["token"] for m in (_NAME.match(n) for n in _namespaces()) if m}
    tokens |= {m["token"] for m in (_LINK.match(n) for n in _links()) if m}
    tokens |= {p.stem for p in STATE_DIR.glob("*.lock")} if STATE_DIR.is_dir() else set()
    swept = sorted(t for t in tokens if not _owner_alive(t))
    for token in swept:
        log.warning("removing the network namespaces of launch %s, whose runner is gone", token)
        remove_token(token)
        (STATE_DIR / f"{token}.lock").unlink(missing_ok=True)
    return swept


def leftovers(token: str) -> list[str]:
    """What of a launch's network still exists (tests: nothing, once its runner is gone)."""
    names = [n for n in _namespaces() if (m := _NAME.match(n)) and m["token"] == token]
    names += [n for n in _links() if (m := _LINK.match(n)) and m["token"] == token]
    names += [str(p) for p in ETC_NETNS.glob(f"rt-{token}-*")] if ETC_NETNS.is_dir() else []
    return names


class LoopbackNetwork:
    """Today's: every node on this machine's loopback, 127.0.0.<index + 1> (a stable address per index)."""

    services_address = "127.0.0.1"

    def services_prefix(self) -> list[str]:
        return []

    def start_node(self, index: int) -> tuple[list[str], str]:
        assert index < 254, "one loopback address per local node"
        return [], f"127.0.0.{index + 1}"

    def close(self) -> None:
        pass


@dataclass
class _Namespace:
    name: str
    link: str  # the veth end on the bridge, in this machine's namespace: set down, the namespace is cut off
    address: str
    host: str
    frozen: bool = False  # replaced while cut off: its hosts file keeps the world as it was


@dataclass
class NamespaceNetwork:
    """A bridge, a namespace for the services and one per node incarnation; see the module's docstring."""

    token: str
    bridge: str = ""
    serial: int = 0
    services: _Namespace | None = None
    nodes: dict[int, list[_Namespace]] = field(default_factory=dict)  # node index -> its incarnations, newest last
    keeper: subprocess.Popen | None = None
    lock_handle: object = None

    @classmethod
    def create(cls, token: str) -> "NamespaceNetwork":
        problem = netns_problem()
        if problem:
            raise NetworkUnavailable(problem)
        sweep()
        network = cls(token=token[:TOKEN_CHARS])
        network._hold_and_keep()
        try:
            network.bridge = f"rt{network.token}b"
            _ip("link", "add", network.bridge, "type", "bridge")
            _ip("link", "set", network.bridge, "up")
            network.services = network._namespace(f"rt-{network.token}-s", SERVICES_ADDRESS, SERVICES_HOST)
        except BaseException:
            network.close()
            raise
        return network

    def _hold_and_keep(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        handle = (STATE_DIR / f"{self.token}.lock").open("a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        self.lock_handle = handle
        # The keeper shares the lock (one open file): a start sweeps the token only once both are gone.
        self.keeper = subprocess.Popen([sys.executable, "-m", "localcluster.network", "keep", self.token,
                                        str(os.getpid())], pass_fds=(handle.fileno(),), start_new_session=True,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def _namespace(self, name: str, address: str, host: str) -> _Namespace:
        self.serial += 1
        link = f"rt{self.token}v{self.serial}"
        _ip("netns", "add", name)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("link", "set", link, "master", self.bridge)
        _ip("link", "set", link, "up")
        prefix = ipaddress.ip_network(SUBNET).prefixlen
        _ip("-n", name, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        namespace = _Namespace(name, link, address, host)
        (ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
        return namespace

    def _hosts_text(self) -> str:
        lines = ["127.0.0.1 localhost", f"{SERVICES_ADDRESS} {SERVICES_HOST}"]
        lines += [f"{incarnations[-1].address} {node_host(index)}" for index, incarnations in sorted(self.nodes.items())]
        return "\n".join(lines) + "\n"

    def _write_hosts(self) -> None:
        """Every live namespace's view of who is where. Written in place: a running process sees the bind-mounted
        file change (it resolves names as it goes), as pods see DNS follow a replaced pod."""
        text = self._hosts_text()
        current = [self.services] + [incarnations[-1] for incarnations in self.nodes.values()]
        for namespace in current + [n for incs in self.nodes.values() for n in incs[:-1] if not n.frozen]:
            path = ETC_NETNS / namespace.name / "hosts"
            with path.open("a+") as handle:  # same inode: the bind mount inside the namespace follows
                handle.seek(0)
                handle.truncate()
                handle.write(text)

    @property
    def services_address(self) -> str:
        return SERVICES_ADDRESS

    def _prefix(self, namespace: _Namespace) -> list[str]:
        # A host name of its own (a new UTS namespace), as each pod has: torchft and gloo advertise gethostname().
        return ["ip", "netns", "exec", namespace.name, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                namespace.host]

    def services_prefix(self) -> list[str]:
        assert self.services is not None
        self._write_hosts()
        return self._prefix(self.services)

    def start_node(self, index: int) -> tuple[list[str], str]:
        """A new machine for node `index` (its first, or a replacement): (command prefix, the host name its
        launcher gives the rendezvous — the same for every incarnation, as a pod's)."""
        assert index < 155, "node addresses 10.77.100-254.x"
        incarnations = self.nodes.setdefault(index, [])
        for earlier in incarnations:
            earlier.frozen = True
        namespace = self._namespace(f"rt-{self.token}-n{index}k{len(incarnations)}", f"10.77.{100 + index}.{len(incarnations) + 2}",
                                    node_host(index))
        incarnations.append(namespace)
        self._write_hosts()
        return self._prefix(namespace), node_host(index)

    def incarnation(self, index: int) -> int:
        return len(self.nodes[index]) - 1

    def set_node_link(self, index: int, up: bool, incarnation: int | None = None) -> None:
        namespace = self.nodes[index][self.incarnation(index) if incarnation is None else incarnation]
        _ip("link", "set", namespace.link, "up" if up else "down")

    def set_services_link(self, up: bool) -> None:
        assert self.services is not None
        _ip("link", "set", self.services.link, "up" if up else "down")

    def close(self) -> None:
        remove_token(self.token)
        if self.keeper is not None:
            self.keeper.kill()
            self.keeper.wait()
        if self.lock_handle is not None:
            (STATE_DIR / f"{self.token}.lock").unlink(missing_ok=True)
            self.lock_handle.close()


def node_network(mode: str, token: str | None = None) -> LoopbackNetwork | NamespaceNetwork:
    if mode == "netns":
        return NamespaceNetwork.create(token or uuid.uuid4().hex)
    return LoopbackNetwork()


def _keep(token: str, parent: int) -> int:
    """The keeper: once the runner (parent) is gone, remove its launch's network."""
    while os.getppid() == parent:  # re-parented once the runner is gone (a zombie runner still answers kill 0)
        time.sleep(0.2)
    remove_token(token)
    (STATE_DIR / f"{token}.lock").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m localcluster.network")
    parser.add_argument("command", choices=["keep", "sweep"])
    parser.add_argument("token", nargs="?")
    parser.add_argument("parent", nargs="?", type=int)
    args = parser.parse_args()
    if args.command == "keep":
        sys.exit(_keep(args.token, args.parent))
    print("\n".join(sweep()))
