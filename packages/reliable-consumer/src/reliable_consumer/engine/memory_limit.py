"""The memory limit the kernel holds the worker to: its cgroup's, when one is set.

A container's memory limit (deploy/k8s: 512 Mi) is its cgroup's; past it the kernel
OOM-kills the process. The worker exports it as ``worker_memory_limit_bytes`` beside its
RSS (``process_resident_memory_bytes``), so the alert compares RSS with the limit that
applies to this process rather than with a number copied from a manifest.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_MOUNT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned 64-bit number (~9.2e18); no
# machine has memory within a factor of a thousand of this.
NO_LIMIT_FROM = 2**53


def memory_limit_bytes(mount: Path = CGROUP_MOUNT, membership: Path = PROC_CGROUP) -> int | None:
    """The smallest memory limit on the process's cgroup and its ancestors; None if none.

    ``membership`` (``/proc/self/cgroup``) names the process's cgroup in each hierarchy:
    the unified one (cgroup v2, line ``0::<path>``, limit in ``memory.max``, "max" when
    none) and the v1 memory controller's (``<n>:memory:<path>``, ``memory.limit_in_bytes``).
    A parent's limit binds its children too, so each directory from the process's cgroup
    up to the mount is read. In a container the process's cgroup is its namespace's root,
    the mount itself, which holds the container's limit.
    """
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not controllers:
            limits += _limits_upwards(mount, path, "memory.max")
        elif "memory" in controllers.split(","):
            limits += _limits_upwards(mount / "memory", path, "memory.limit_in_bytes")
    return min(limits) if limits else None


def _limits_upwards(root: Path, path: str, name: str) -> list[int]:
    """The limits in ``name`` from the cgroup at ``path`` up to ``root``; a directory that is
    not there (a path from outside the process's namespace) has none."""
    found: list[int] = []
    here = root / path.lstrip("/")
    while True:
        limit = _read_limit(here / name)
        if limit is not None:
            found.append(limit)
        if here == root or root not in here.parents:
            return found
        here = here.parent


def _read_limit(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max", or not a limit file at all
        return None
    value = int(text)
    return value if value < NO_LIMIT_FROM else None
