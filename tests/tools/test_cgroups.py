"""Which cgroup mechanism the sandbox uses on which machine (read from fake /proc files and cgroup trees, so the v2
branch is exercised on this cgroup-v1 machine too), and a real call cgroup on this machine: its limits, that the
command joins it before it runs, and that nothing of it is left."""

import logging
import subprocess
from pathlib import Path

import pytest

from hybridflow.tools import cgroups
from hybridflow.tools.cgroups import CallCgroup, Cgroups, Hierarchy, detect, machine_cgroups

V1_MOUNTINFO = """\
31 23 0:28 / {root} rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / {root}/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / {root}/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_CGROUP = "8:pids:/\n4:memory:/jobs/job-7\n1:cpu:/\n0::/\n"
V2_MOUNTINFO = "30 23 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def fake_proc(tmp_path: Path, mountinfo: str, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text(mountinfo.format(root=tmp_path / "cg"))
    (proc / "cgroup").write_text(cgroup)
    return proc


@pytest.fixture
def no_probe(monkeypatch):
    """Fake cgroup trees are plain directories: making and removing a child there proves nothing."""
    monkeypatch.setattr(cgroups, "_probe", lambda hierarchy: None)


def test_v1_hierarchies_are_used_under_this_process_cgroups(tmp_path, no_probe):
    (tmp_path / "cg/memory/jobs/job-7").mkdir(parents=True)
    (tmp_path / "cg/pids").mkdir(parents=True)
    (tmp_path / "cg/unified").mkdir(parents=True)
    (tmp_path / "cg/unified/cgroup.controllers").write_text("hugetlb\n")
    (tmp_path / "cg/unified/cgroup.subtree_control").write_text("\n")
    found = detect(fake_proc(tmp_path, V1_MOUNTINFO, V1_CGROUP))
    assert found.hierarchies == (
        Hierarchy(1, tmp_path / "cg/memory/jobs/job-7", ("memory",)),
        Hierarchy(1, tmp_path / "cg/pids", ("pids",)),
    )
    assert found.has("memory") and found.has("pids") and found.problems == ()


def test_v2_is_used_where_children_can_have_memory_and_pids(tmp_path, no_probe):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (root / "cgroup.subtree_control").write_text("memory pids\n")
    found = detect(fake_proc(tmp_path, V2_MOUNTINFO, "0::/\n"))
    assert found.hierarchies == (Hierarchy(2, root, ("memory", "pids")),)
    settings = found.hierarchies[0].settings(64 * 2**20, 35)
    assert settings == [
        ("memory.max", str(64 * 2**20), True),
        ("memory.swap.max", "0", False),
        ("memory.oom.group", "1", False),
        ("pids.max", "35", True),
    ]


def test_v2_uses_the_delegated_parent_of_a_cgroup_that_holds_processes(tmp_path, no_probe, monkeypatch):
    """A container whose processes were moved from its cgroup root to a child (/init): the root gives its children
    memory and pids, and the sandboxes are made beside /init. A delegated systemd service is the same shape."""
    root = tmp_path / "cg"
    (root / "init").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory pids\n")
    (root / "cgroup.subtree_control").write_text("memory pids\n")
    (root / "init/cgroup.controllers").write_text("memory pids\n")
    (root / "init/cgroup.subtree_control").write_text("")
    monkeypatch.setattr(cgroups, "_write", lambda path, value: pytest.fail(f"wrote {value} to {path}"))
    found = detect(fake_proc(tmp_path, V2_MOUNTINFO, "0::/init\n"))
    assert found.hierarchies == (Hierarchy(2, root, ("memory", "pids")),)


def test_a_v2_cgroup_whose_parent_is_not_delegated_is_reported_not_used(tmp_path, no_probe, monkeypatch):
    job = tmp_path / "cg/system.slice/job.service"
    job.mkdir(parents=True)
    for directory in (job, job.parent):
        (directory / "cgroup.controllers").write_text("memory pids\n")
        (directory / "cgroup.subtree_control").write_text("memory pids\n" if directory == job.parent else "")
    monkeypatch.setattr(cgroups, "_write", lambda path, value: pytest.fail(f"wrote {value} to {path}"))
    found = detect(fake_proc(tmp_path, V2_MOUNTINFO, "0::/system.slice/job.service\n"))
    assert found.hierarchies == () and not found.has("memory")
    assert "its parent is not delegated" in found.describe()
    assert "no usable memory controller" in found.describe()


def test_v2_at_the_root_enables_memory_and_pids_for_the_children(tmp_path, no_probe):
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids io\n")
    (root / "cgroup.subtree_control").write_text("io\n")
    found = detect(fake_proc(tmp_path, V2_MOUNTINFO, "0::/\n"))
    assert found.hierarchies == (Hierarchy(2, root, ("memory", "pids")),)
    assert (root / "cgroup.subtree_control").read_text() == "+memory +pids"  # what the kernel is told


def test_without_a_memory_controller_a_warning_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(cgroups, "detect", lambda: Cgroups(problems=("no usable memory controller",)))
    machine_cgroups.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hybridflow.tools.cgroups"):
            machine_cgroups()
            machine_cgroups()
    finally:
        machine_cgroups.cache_clear()
    assert [r.message.count("no cgroup memory controller") for r in caplog.records] == [1]
    assert "RLIMIT_AS" in caplog.records[0].message


def test_v1_settings_set_memory_without_swap_and_processes():
    limit = str(32 * 2**20)
    settings = Hierarchy(1, Path("/x"), ("memory",)).settings(32 * 2**20, 19)
    assert settings == [("memory.limit_in_bytes", limit, True), ("memory.memsw.limit_in_bytes", limit, False)]
    assert Hierarchy(1, Path("/x"), ("pids",)).settings(1, 19) == [("pids.max", "19", True)]


def this_machine() -> Cgroups:
    found = machine_cgroups()
    if not found.has("memory"):
        pytest.skip(f"this machine gives this process no cgroup memory controller: {found.describe()}")
    return found


def test_a_call_cgroup_has_the_limits_is_joined_before_the_command_runs_and_is_removed():
    found = this_machine()
    call = CallCgroup(found, 48 * 2**20, 11)
    try:
        dirs = [directory for _, directory in call.dirs]
        assert all(d.is_dir() and d.name.startswith(cgroups.PREFIX) for d in dirs)
        memory = next(d for h, d in call.dirs if "memory" in h.controllers)
        limit = "memory.max" if (memory / "memory.max").exists() else "memory.limit_in_bytes"
        assert int((memory / limit).read_text()) == 48 * 2**20
        if found.has("pids"):
            pids = next(d for h, d in call.dirs if "pids" in h.controllers)
            assert (pids / "pids.max").read_text().strip() == "11"
        shown = subprocess.run(call.join_command(["cat", "/proc/self/cgroup"]), capture_output=True, text=True)
        joined = [line for line in shown.stdout.splitlines() if dirs[0].name in line]
        assert shown.returncode == 0 and len(joined) == len(dirs)  # cat itself ran in each of the call's cgroups
    finally:
        call.kill()
        assert call.remove()
    assert not any(d.exists() for d in dirs)
