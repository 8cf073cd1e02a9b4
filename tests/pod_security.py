"""The Pod Security Standards, as Pod Security Admission enforces them, for checking pod templates offline.

Source: Kubernetes documentation, "Pod Security Standards" (kubernetes.io/docs/concepts/security/
pod-security-standards/), policy version v1.33: the Baseline controls (host namespaces, privileged
containers, capabilities, hostPath volumes, host ports, AppArmor, SELinux, /proc mount type, seccomp,
sysctls) and the Restricted controls on top (volume types, privilege escalation, running as non-root,
non-root user, seccomp, capabilities). `violations(pod_spec, level)` returns one line per control broken.
"""

from __future__ import annotations

from typing import Any

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
LEVELS = ("privileged", "baseline", "restricted")


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]


def _baseline(pod: dict[str, Any]) -> list[str]:
    problems = []
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            problems.append(f"host namespaces: {field} is true")
    pod_context = pod.get("securityContext", {})
    for sysctl in pod_context.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            problems.append(f"sysctls: {sysctl['name']} is not a safe sysctl")
    for volume in pod.get("volumes", []):
        if "hostPath" in volume:
            problems.append(f"hostPath volumes: {volume['name']}")
    contexts = [("pod", pod_context)] + [(c["name"], c.get("securityContext", {})) for c in _containers(pod)]
    for name, context in contexts:
        if context.get("seccompProfile", {}).get("type") == "Unconfined":
            problems.append(f"seccomp: {name} is Unconfined")
        selinux = context.get("seLinuxOptions", {})
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            problems.append(f"SELinux: {name} sets {selinux}")
        apparmor = context.get("appArmorProfile", {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            problems.append(f"AppArmor: {name} is {apparmor}")
    for container in _containers(pod):
        context = container.get("securityContext", {})
        if context.get("privileged"):
            problems.append(f"privileged containers: {container['name']}")
        added = set(context.get("capabilities", {}).get("add", []))
        if added - BASELINE_CAPABILITIES:
            problems.append(f"capabilities: {container['name']} adds {sorted(added - BASELINE_CAPABILITIES)}")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                problems.append(f"host ports: {container['name']} uses hostPort {port['hostPort']}")
        if context.get("procMount", "Default") != "Default":
            problems.append(f"/proc mount type: {container['name']} is {context['procMount']}")
    return problems


def _restricted(pod: dict[str, Any]) -> list[str]:
    problems = []
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"volume types: {volume['name']} is {sorted(kinds)}")
    pod_context = pod.get("securityContext", {})
    pod_seccomp = pod_context.get("seccompProfile", {}).get("type")
    for container in _containers(pod):
        context = container.get("securityContext", {})
        name = container["name"]
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"privilege escalation: {name} does not set allowPrivilegeEscalation: false")
        if not context.get("runAsNonRoot", pod_context.get("runAsNonRoot", False)):
            problems.append(f"running as non-root: {name} has no runAsNonRoot: true")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            problems.append(f"running as non-root user: {name} runs as uid 0")
        if context.get("seccompProfile", {}).get("type", pod_seccomp) not in ("RuntimeDefault", "Localhost"):
            problems.append(f"seccomp: {name} sets no RuntimeDefault or Localhost profile")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"capabilities: {name} does not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"capabilities: {name} adds {sorted(set(capabilities['add']) - {'NET_BIND_SERVICE'})}")
    if pod_context.get("runAsUser") == 0:
        problems.append("running as non-root user: the pod runs as uid 0")
    return problems


def violations(pod: dict[str, Any], level: str) -> list[str]:
    assert level in LEVELS, level
    if level == "privileged":
        return []
    problems = _baseline(pod)
    if level == "restricted":
        problems += _restricted(pod)
    return problems
