"""How many cores this container may use: what `--processes auto` starts.

A pod's CPU limit is its cgroup's CPU quota; the process's CPU affinity says which cores
the kernel lets it run on. The smaller of the two is how many single-threaded workers can
each have a core (the quota rounded up: a limit of 1.5 cores still gives a second worker
half a core's time).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_MOUNT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cores(mount: Path = CGROUP_MOUNT, membership: Path = PROC_CGROUP) -> int:
    """The cores this process may run on, bounded by its cgroup's CPU quota; at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cpu_quota(mount, membership)
    if quota is not None:
        cores = min(cores or 1, math.ceil(quota))
    return max(1, cores or 1)


def cpu_quota(mount: Path = CGROUP_MOUNT, membership: Path = PROC_CGROUP) -> float | None:
    """The smallest CPU quota (in cores) on the process's cgroup and its ancestors, if any.

    cgroup v2 writes it as ``cpu.max`` ("<quota> <period>", "max" when none); v1's cpu
    controller as ``cpu.cfs_quota_us`` (-1 when none) over ``cpu.cfs_period_us``.
    """
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not controllers:
            for directory in _upwards(mount, path):
                quotas += _v2_quota(directory / "cpu.max")
        elif "cpu" in controllers.split(","):
            root = mount / ("cpu,cpuacct" if "cpuacct" in controllers else "cpu")
            for directory in _upwards(root, path):
                quotas += _v1_quota(directory)
    return min(quotas) if quotas else None


def _upwards(root: Path, path: str) -> list[Path]:
    """The process's cgroup directory and each parent up to the mount."""
    directory = root / path.lstrip("/")
    found = [directory]
    while directory != root and root in directory.parents:
        directory = directory.parent
        found.append(directory)
    return found


def _v2_quota(file: Path) -> list[float]:
    try:
        quota, period = file.read_text().split()
    except (OSError, ValueError):
        return []
    if quota == "max" or int(period) <= 0:
        return []
    return [int(quota) / int(period)]


def _v1_quota(directory: Path) -> list[float]:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return []
    if quota <= 0 or period <= 0:
        return []
    return [quota / period]
