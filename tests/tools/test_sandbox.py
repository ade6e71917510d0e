"""The Python sandbox: normal code runs, and each isolation and limit holds against code that tries to break it.

Every check looks at what happened (the run's result, host files, host processes), not at the sandbox's settings.
Processes of a run are found on the host by a unique marker in the code (it is in their command lines).
"""

import ast
import asyncio
import socket
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest
from sandbox_helpers import new_marker, processes_with, run, until

from hybridflow.tools.sandbox import SandboxLimits, SandboxResult, check_sandbox, run_python


def test_sandbox_is_available():
    check_sandbox()


def test_limits_are_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=-1)
    with pytest.raises(ValueError, match="cpu_time_s"):
        SandboxLimits(cpu_time_s=1.5)


def test_code_runs_and_prints():
    result = run("print(sum(range(10)))")
    assert (result.stdout, result.stderr, result.exit_code, result.error) == ("45\n", "", 0, None)
    assert not result.timed_out and not result.output_truncated
    assert result.as_tool_output() == "45"


def test_stdin_reaches_the_code():
    assert run("import sys; print(sys.stdin.read().upper())", stdin="hello\n").stdout == "HELLO\n\n"


def test_an_exception_in_the_code_is_the_codes_error_not_the_sandboxs():
    result = run("x = 1\n1 / 0")
    assert result.exit_code == 1 and result.error is None
    assert "ZeroDivisionError: division by zero" in result.stderr
    assert "ZeroDivisionError" in result.as_tool_output()


def test_concurrent_runs_overlap_and_keep_their_own_directories():
    code = "import os, sys, time\nopen('mine', 'w').write(sys.stdin.read())\ntime.sleep(0.5)\n"
    code += "print(sorted(os.listdir('.')), open('mine').read())"

    async def many() -> tuple[float, list[SandboxResult], float]:
        start = time.monotonic()
        await run_python(code, stdin="solo")
        single = time.monotonic() - start
        start = time.monotonic()
        results = await asyncio.gather(*(run_python(code, stdin=str(i)) for i in range(8)))
        return single, results, time.monotonic() - start

    single, results, together = asyncio.run(many())
    assert [r.stdout for r in results] == [f"['.tmp', 'mine'] {i}\n" for i in range(8)]  # .tmp: where /tmp is
    assert together < 4 * single  # eight at once in the time of four one after another


def test_no_network_not_even_the_hosts_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    port = server.getsockname()[1]
    code = f"""
import socket
for address in [("127.0.0.1", {port}), ("1.1.1.1", 80)]:
    try:
        socket.create_connection(address, timeout=3).close()
        print("connected", address)
    except OSError as e:
        print("failed", address, repr(e))
"""
    with server:
        result = run(code)
        with pytest.raises(BlockingIOError):  # nothing reached the host's server
            server.accept()
    assert result.stdout.count("failed") == 2 and "connected" not in result.stdout
    assert "ConnectionRefusedError" in result.stdout  # the sandbox's own loopback: nobody listens there
    assert result.error is None


def test_host_files_are_not_visible():
    assert Path("/etc/passwd").exists() and Path(__file__).exists()
    code = f"""
import os
print(sorted(os.listdir("/")))
for path in ["/etc/passwd", {str(Path(__file__).resolve())!r}, "/root"]:
    try:
        open(path).read()
    except OSError as e:
        print(type(e).__name__)
"""
    lines = run(code).stdout.splitlines()
    entries = set(ast.literal_eval(lines[0]))
    assert {"usr", "proc", "tmp", "dev"} <= entries <= {"bin", "dev", "lib", "lib64", "proc", "python", "sandbox",
                                                        "tmp", "usr"}  # fmt: skip
    assert lines[1:] == ["FileNotFoundError"] * 3


def test_system_directories_are_read_only():
    code = """
import errno, os, sys
print([bool(os.statvfs(d).f_flag & os.ST_RDONLY) for d in ("/usr", sys.prefix)])
try:
    open("/usr/hacked", "w")
except OSError as e:
    print(errno.errorcode[e.errno])
"""
    assert run(code).stdout.splitlines() == ["[True, True]", "EROFS"]
    assert not Path("/usr/hacked").exists()


def test_host_paths_cannot_be_written(tmp_path: Path):
    secret = tmp_path / "secret.txt"
    secret.write_text("original")
    code = f"""
for path in [{str(secret)!r}, {str(tmp_path / "new.txt")!r}]:
    try:
        open(path, "w").write("overwritten")
        print("wrote", path)
    except OSError as e:
        print(type(e).__name__)
"""
    assert run(code).stdout.splitlines() == ["FileNotFoundError"] * 2
    assert secret.read_text() == "original" and sorted(tmp_path.iterdir()) == [secret]


def test_the_working_directory_is_a_tmpfs_of_its_own_and_nothing_of_it_reaches_the_host():
    name = f"result-{uuid.uuid4().hex}.txt"
    code = f"import os, time\nopen({name!r}, 'w').write('42')\nopen('/tmp/' + {name!r}, 'w').write('43')\n"
    code += "mounts = [line.split()[1:3] for line in open('/proc/self/mounts')]\n"
    code += f"print(os.getcwd(), open({name!r}).read(), mounts, flush=True)\ntime.sleep(1)"

    def on_host() -> list[Path]:  # where the host directory of the code used to be, and anywhere below it
        return [*Path(tempfile.gettempdir()).glob(f"*/{name}"), *Path(tempfile.gettempdir()).glob(f"*/*/{name}")]

    async def scenario() -> tuple[SandboxResult, list[Path]]:
        task = asyncio.create_task(run_python(code))
        seen = []
        while not task.done():  # look all along the run
            seen += on_host()
            await asyncio.sleep(0.05)
        return await task, seen

    result, seen = asyncio.run(scenario())
    cwd, value, mounts = result.stdout.split(" ", 2)
    assert (cwd, value, result.error) == ("/sandbox", "42", None)
    mounts = ast.literal_eval(mounts)
    assert ["/sandbox", "tmpfs"] in mounts and [m for m in mounts if m[0] == "/tmp"] == []  # /tmp links into it
    assert seen == [] and on_host() == []


def test_the_code_runs_unprivileged():
    code = "import os\nprint(os.getuid() != 0, [l for l in open('/proc/self/status') if l.startswith('CapEff')])"
    assert run(code).stdout == "True ['CapEff:\\t0000000000000000\\n']\n"


def test_cpu_time_is_limited():
    """The CPU limit stops the loop, not the wall timeout: that is far away, so a loaded machine (where 1 s of CPU
    takes many seconds) cannot make the test pass or fail by timing."""
    result = run("while True: pass", SandboxLimits(cpu_time_s=1, timeout_s=120))
    assert not result.timed_out and result.error is not None and "CPU time" in result.error, result


def test_memory_is_limited():
    result = run("bytearray(10 * 2**30)", SandboxLimits(memory_mb=256))
    assert result.error == "memory limit of 256 MB exceeded" and "MemoryError" in result.stderr
    assert run("print(len(bytearray(100 * 2**20)))", SandboxLimits(memory_mb=256)).stdout == f"{100 * 2**20}\n"


def test_file_size_is_limited():
    result = run("open('big', 'wb').write(bytes(3 * 2**20))", SandboxLimits(max_file_mb=1))
    assert "file size limit" in result.error and "File too large" in result.stderr


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing_behind():
    marker = new_marker()
    code = f"# {marker}\nimport os\nwhile True:\n    os.fork()"
    result = run(code, SandboxLimits(max_processes=16, timeout_s=120))  # the timeout far away: the limit stops it
    assert not result.timed_out and result.error.startswith("process limit reached"), result
    assert processes_with(marker) == []


def test_output_is_capped_and_read_in_bounded_memory():
    tracemalloc.start()
    try:
        start = time.monotonic()
        result = run("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)")
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.output_truncated and result.error == "output exceeded 65536 bytes (killed)"
    assert result.stdout == "x" * 65536 and result.exit_code is None
    assert elapsed < 5 and peak < 16 * 2**20


def test_the_wall_timeout_kills_every_process_of_the_sandbox():
    marker = new_marker()
    code = f"""import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(100)  # {marker}"])
print("started", flush=True)
print("error", file=sys.stderr, flush=True)
time.sleep(100)
"""

    async def scenario() -> tuple[SandboxResult, bool, float]:
        start = time.monotonic()
        task = asyncio.create_task(run_python(code, SandboxLimits(timeout_s=1.0)))
        seen = await until(lambda: len(processes_with(marker)) > 0)
        return await task, seen, time.monotonic() - start

    result, seen, elapsed = asyncio.run(scenario())
    assert seen and elapsed < 60  # killed at its 1 s timeout, not after the code's 100 s (slack for a loaded machine)
    assert result.timed_out and result.exit_code is None and result.error == "timed out after 1.0 s (killed)"
    assert result.as_tool_output() == f"started\nerror\nError: {result.error}"
    assert processes_with(marker) == []


def test_background_processes_die_when_the_code_exits():
    marker = new_marker()
    code = (
        f'import subprocess, sys\nsubprocess.Popen([sys.executable, "-c", "import time; time.sleep(100)  # {marker}"])'
    )
    start = time.monotonic()
    result = run(code)
    assert result.exit_code == 0 and time.monotonic() - start < 3
    assert processes_with(marker) == []


def test_a_cancelled_run_leaves_nothing_behind():
    marker = new_marker()
    code = f"import time\ntime.sleep(100)  # {marker}"

    async def scenario() -> bool:
        task = asyncio.create_task(run_python(code))
        seen = await until(lambda: len(processes_with(marker)) > 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    assert asyncio.run(scenario())
    assert processes_with(marker) == []
