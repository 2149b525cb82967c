"""The memory limit read from the process's cgroup (engine/memory_limit.py), on cgroup trees
laid out as the kernel lays them out, in a temporary directory."""

from __future__ import annotations

from pathlib import Path

from reliable_consumer.engine.memory_limit import memory_limit_bytes

MIB = 1024 * 1024
# What cgroup v1 reports for "no limit".
V1_UNLIMITED = "9223372036854771712"


def cgroup_tree(tmp_path: Path, membership: str, files: dict[str, str]) -> tuple[Path, Path]:
    mount = tmp_path / "cgroup"
    for name, text in files.items():
        (mount / name).parent.mkdir(parents=True, exist_ok=True)
        (mount / name).write_text(text + "\n")
    mount.mkdir(exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(membership)
    return mount, proc


def test_a_container_on_cgroup_v2_reads_its_namespace_roots_memory_max(tmp_path: Path) -> None:
    mount, proc = cgroup_tree(tmp_path, "0::/\n", {"memory.max": str(512 * MIB)})
    assert memory_limit_bytes(mount, proc) == 512 * MIB


def test_max_means_no_limit(tmp_path: Path) -> None:
    mount, proc = cgroup_tree(tmp_path, "0::/\n", {"memory.max": "max"})
    assert memory_limit_bytes(mount, proc) is None


def test_a_parents_smaller_limit_binds_the_process_cgroup(tmp_path: Path) -> None:
    mount, proc = cgroup_tree(
        tmp_path,
        "0::/kubepods/pod1/worker\n",
        {
            "kubepods/pod1/memory.max": str(256 * MIB),
            "kubepods/pod1/worker/memory.max": str(512 * MIB),
            "kubepods/memory.max": "max",
        },
    )
    assert memory_limit_bytes(mount, proc) == 256 * MIB


def test_cgroup_v1_reads_the_memory_controllers_limit_and_its_no_limit_number(
    tmp_path: Path,
) -> None:
    membership = "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"
    limited, proc = cgroup_tree(
        tmp_path / "a",
        membership,
        {
            "memory/docker/abc/memory.limit_in_bytes": str(300 * MIB),
            "memory/memory.limit_in_bytes": V1_UNLIMITED,
        },
    )
    assert memory_limit_bytes(limited, proc) == 300 * MIB
    unlimited, proc = cgroup_tree(
        tmp_path / "b", membership, {"memory/memory.limit_in_bytes": V1_UNLIMITED}
    )
    assert memory_limit_bytes(unlimited, proc) is None


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    mount, proc = cgroup_tree(tmp_path, "0::/user.slice/session-1.scope\n", {})
    assert memory_limit_bytes(mount, proc) is None
    assert memory_limit_bytes(mount, tmp_path / "no-such-proc-file") is None
