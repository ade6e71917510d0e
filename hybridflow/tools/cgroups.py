"""A control group per sandboxed call: the memory of everything the call runs, as the kernel counts it, and its
number of processes.

An address-space limit (RLIMIT_AS) bounds one process's mappings, not memory the code holds outside them: files
in memory-backed file systems (tmpfs, memfd, /dev/shm), pipe buffers, kernel objects, or many processes each
below the limit. A cgroup's memory limit counts every page charged to it, whoever maps it; the sandbox puts all
its processes in a fresh one per call. Which mechanism, when (``detect``, once per process):

- cgroup v2, where a cgroup that may have children with the ``memory`` and ``pids`` controllers is this
  process's: its own cgroup where that is the hierarchy's root (a machine without systemd), else the parent of
  its own where that is delegated to it (systemd's ``Delegate=yes`` with the process in a child cgroup of the
  delegated one, as systemd asks; a container whose processes were moved to a child of its cgroup root): one
  child per call with ``memory.max``, ``memory.swap.max = 0``, ``memory.oom.group = 1`` (an out-of-memory kill
  takes the whole sandbox) and ``pids.max``;
- cgroup v1 (hybrid hierarchies, as on the machines this was built on), where the ``memory`` and ``pids``
  hierarchies are writable: a child of this process's cgroup in each, with ``memory.limit_in_bytes``,
  ``memory.memsw.limit_in_bytes`` (no swap; where the kernel accounts swap) and ``pids.max``;
- a controller found in neither is not used; without a memory controller a warning is logged once and memory
  is bounded per process only (sandbox.py lists what then holds). The choice can be read in ``describe()``.

A call's cgroup is in this process's own cgroup or the delegated one around it, so whatever limits the caller
(a container, a job's cgroup) still covers the sandbox. Its processes are put in it before any of them runs
code: the command starts as a shell that writes its own pid to each ``cgroup.procs`` and then execs bubblewrap
(``join_command``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "hybridflow-sandbox-"  # + "<pid of the creating process>-<random>"
OVERHEAD_PROCESSES = 3  # besides the code's own: bwrap's monitor, the pid namespace's init, the bootstrap
CONTROLLERS = ("memory", "pids")
# A shell joins every cgroup named before "--", then becomes the command after it.
JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'


@dataclass(frozen=True)
class Hierarchy:
    """Where this process makes its calls' cgroups in one cgroup hierarchy, and what they limit there."""

    version: int  # 1 or 2
    parent: Path  # this process's own cgroup in that hierarchy: each call's cgroup is a child of it
    controllers: tuple[str, ...]  # of CONTROLLERS

    def settings(self, memory_bytes: int, processes: int) -> list[tuple[str, str, bool]]:
        """(file, value, required) to write in a new cgroup; a file that is not required may be missing."""
        out = []
        if "memory" in self.controllers and self.version == 2:
            out += [("memory.max", str(memory_bytes), True), ("memory.swap.max", "0", False)]
            out += [("memory.oom.group", "1", False)]
        elif "memory" in self.controllers:  # memsw (memory + swap) must not be below the memory limit: set after it
            out += [("memory.limit_in_bytes", str(memory_bytes), True)]
            out += [("memory.memsw.limit_in_bytes", str(memory_bytes), False)]
        if "pids" in self.controllers:
            out.append(("pids.max", str(processes), True))
        return out


@dataclass(frozen=True)
class Cgroups:
    """The hierarchies the sandbox uses on this machine (each controller in at most one); empty: none."""

    hierarchies: tuple[Hierarchy, ...] = ()
    problems: tuple[str, ...] = ()  # why a controller is not used

    def has(self, controller: str) -> bool:
        return any(controller in h.controllers for h in self.hierarchies)

    def describe(self) -> str:
        used = [f"{'+'.join(h.controllers)}: cgroup v{h.version} under {h.parent}" for h in self.hierarchies]
        return "; ".join(used + list(self.problems)) or "no cgroup"


class CallCgroup:
    """One call's cgroup (a directory in each hierarchy). Made with the limits set; ``remove`` after the call."""

    def __init__(self, cgroups: Cgroups, memory_bytes: int, processes: int) -> None:
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.dirs: list[tuple[Hierarchy, Path]] = []
        try:
            for hierarchy in cgroups.hierarchies:
                directory = hierarchy.parent / name
                directory.mkdir()
                self.dirs.append((hierarchy, directory))
                for file, value, required in hierarchy.settings(memory_bytes, processes):
                    if required or (directory / file).exists():
                        _write(directory / file, value)
        except OSError:
            self.remove()
            raise

    def join_command(self, command: list[str]) -> list[str]:
        """``command`` started inside this cgroup: nothing of it runs outside, not even for an instant."""
        procs = [str(directory / "cgroup.procs") for _, directory in self.dirs]
        return ["/bin/sh", "-c", JOIN, "sh", *procs, "--", *command] if procs else command

    def oom_kills(self) -> int:
        """Processes the kernel killed for the memory limit (0 where it does not say)."""
        for hierarchy, directory in self.dirs:
            if "memory" in hierarchy.controllers:
                name = "memory.events" if hierarchy.version == 2 else "memory.oom_control"
                with contextlib.suppress(OSError, ValueError):
                    for line in (directory / name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
        return 0

    def peak_bytes(self) -> int | None:
        """The most memory the call's processes held at once (None where the kernel does not say)."""
        for hierarchy, directory in self.dirs:
            if "memory" in hierarchy.controllers:
                name = "memory.peak" if hierarchy.version == 2 else "memory.max_usage_in_bytes"
                with contextlib.suppress(OSError, ValueError):
                    return int((directory / name).read_text())
        return None

    def kill(self) -> None:
        """SIGKILL every process still in the cgroup (the pid namespace's end has normally done it already)."""
        for hierarchy, directory in self.dirs:
            if hierarchy.version == 2 and (directory / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    _write(directory / "cgroup.kill", "1")
            for _ in range(100):  # v1 has no cgroup.kill: kill what is listed until nothing is
                pids = _pids(directory)
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.01)

    def remove(self, wait_s: float = 2.0) -> bool:
        """Remove the cgroup; a process that has just died may keep it busy for a moment. False if it could
        not (logged; a later ``detect`` in any process removes leftovers of dead processes)."""
        deadline = time.monotonic() + wait_s
        while self.dirs:
            _, directory = self.dirs[-1]
            try:
                directory.rmdir()
            except FileNotFoundError:
                pass
            except OSError as error:
                if time.monotonic() > deadline:
                    log.warning("cannot remove the sandbox's cgroup %s: %s", directory, error)
                    return False
                time.sleep(0.01)
                continue
            self.dirs.pop()
        return True


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)  # O_CREAT: cgroup files exist; the tests' fakes need it
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _pids(directory: Path) -> list[int]:
    try:
        return [int(pid) for pid in (directory / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _mounts(mountinfo: str) -> list[tuple[str, Path, str, set[str]]]:
    """(root within the hierarchy, mount point, file system type, super options) of each mount."""
    out = []
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if len(fields) >= 5 and len(tail) >= 3:
            out.append((fields[3], Path(fields[4]), tail[0], set(tail[2].split(","))))
    return out


def _own_cgroups(cgroup: str) -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" the v2 one (from /proc/self/cgroup)."""
    out = {}
    for line in cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def _directory(mount_root: str, mount_point: Path, path: str) -> Path | None:
    """The directory of cgroup ``path`` under a mount of the hierarchy from ``mount_root``; None if outside it."""
    if not Path(path).is_relative_to(mount_root):
        return None
    return mount_point / Path(path).relative_to(mount_root)


def _probe(hierarchy: Hierarchy) -> str | None:
    """Make a child cgroup with limits and remove it: None if that works, else why not."""
    try:
        CallCgroup(Cgroups((hierarchy,)), 64 * 2**20, 8).remove()
    except OSError as error:
        return f"cannot make a cgroup under {hierarchy.parent}: {error}"
    return None


def _v2(mounts: list, own: dict[str, str]) -> tuple[Hierarchy | None, str | None]:
    """The v2 cgroup whose children the sandboxes can be: this process's own cgroup where it is the hierarchy's
    root (only the root may hold processes and give controllers to children; this enables them there if needed),
    else its parent where that is delegated to it (see ``_delegated``) and already gives memory and pids."""
    for root, point, fstype, _ in mounts:
        if fstype != "cgroup2" or "" not in own or (mine := _directory(root, point, own[""])) is None:
            continue
        if mine == point:
            return _v2_parent(mine, may_enable=True)
        if not _delegated(mine.parent, point):
            return None, (
                f"cgroup v2: this process's cgroup {mine} holds processes, so it cannot give children memory and "
                "pids, and its parent is not delegated (systemd: Delegate=yes, with this process in a child "
                "cgroup of the delegated one; a container: its processes in a child of its cgroup root)"
            )
        return _v2_parent(mine.parent, may_enable=False)
    return None, None


def _v2_parent(parent: Path, may_enable: bool) -> tuple[Hierarchy | None, str | None]:
    try:
        available = set((parent / "cgroup.controllers").read_text().split())
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
    except OSError as error:
        return None, f"cgroup v2 at {parent} unreadable: {error}"
    wanted = tuple(c for c in CONTROLLERS if c in available)
    if not wanted:
        return None, f"cgroup v2 at {parent} has neither memory nor pids"
    if missing := [c for c in wanted if c not in enabled]:
        if not may_enable:
            return None, f"cgroup v2 at {parent} does not give its children {'+'.join(missing)}"
        try:
            _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))
            log.info("enabled %s for the children of %s (for the Python sandbox)", "+".join(missing), parent)
        except OSError as error:
            return None, f"cgroup v2 at {parent} cannot give its children {'+'.join(missing)}: {error}"
    hierarchy = Hierarchy(2, parent, wanted)
    problem = _probe(hierarchy)
    return (None, problem) if problem else (hierarchy, None)


def _delegated(cgroup: Path, mount_point: Path) -> bool:
    """Whether ``cgroup`` is this process's to divide: the root of the hierarchy as mounted here (a container's
    own cgroup namespace), or a cgroup systemd delegated (it marks those with a ``delegate`` extended attribute)."""
    if cgroup == mount_point:
        return True
    for name in ("trusted.delegate", "user.delegate"):
        with contextlib.suppress(OSError):
            if os.getxattr(cgroup, name) == b"1":
                return True
    return False


def _v1(mounts: list, own: dict[str, str], controller: str) -> tuple[Hierarchy | None, str | None]:
    for root, point, fstype, options in mounts:
        if fstype == "cgroup" and controller in options and controller in own:
            if (parent := _directory(root, point, own[controller])) is not None:
                hierarchy = Hierarchy(1, parent, (controller,))
                problem = _probe(hierarchy)
                return (None, problem) if problem else (hierarchy, None)
    return None, None


def detect(proc_self: Path = Path("/proc/self")) -> Cgroups:
    """The cgroups this process can give its sandboxes (v2 first, then v1, per controller); leftovers of dead
    processes are removed on the way."""
    try:
        mounts = _mounts((proc_self / "mountinfo").read_text())
        own = _own_cgroups((proc_self / "cgroup").read_text())
    except OSError as error:
        return Cgroups(problems=(f"cannot read {proc_self}: {error}",))
    hierarchies, problems = [], []
    v2, problem = _v2(mounts, own)
    if v2 is not None:
        hierarchies.append(v2)
    problems += [problem] if problem else []
    for controller in CONTROLLERS:
        if v2 is None or controller not in v2.controllers:
            v1, problem = _v1(mounts, own, controller)
            hierarchies += [v1] if v1 is not None else []
            problems += [problem] if problem else []
    for hierarchy in hierarchies:
        _remove_leftovers(hierarchy.parent)
    missing = [c for c in CONTROLLERS if not any(c in h.controllers for h in hierarchies)]
    problems += [f"no usable {c} controller" for c in missing]
    return Cgroups(tuple(hierarchies), tuple(problems) if missing else ())


def _remove_leftovers(parent: Path) -> None:
    """Empty call cgroups whose creating process is gone (it was killed before it could remove them)."""
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            if entry.name.startswith(PREFIX) and entry.is_dir():
                pid = entry.name.removeprefix(PREFIX).partition("-")[0]
                if pid.isdigit() and not _alive(int(pid)):
                    with contextlib.suppress(OSError):
                        entry.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def machine_cgroups() -> Cgroups:
    """``detect()`` once per process; without a memory controller, a warning (once) says what that means."""
    cgroups = detect()
    if not cgroups.has("memory"):
        log.warning(
            "the Python sandbox has no cgroup memory controller here (%s): memory is limited per process "
            "(RLIMIT_AS), files by the file system size and RLIMIT_FSIZE x RLIMIT_NOFILE, not as one total. "
            "Give this process a delegated cgroup v2 (memory and pids) or writable cgroup v1 hierarchies.",
            cgroups.describe(),
        )
    return cgroups
