"""The seccomp program, read by a small classic-BPF interpreter written here (for both architectures, so the one
this machine cannot run is checked too), and its system call numbers against libseccomp's and the kernel's tables.
That the kernel refuses each call in the sandbox is tested in test_sandbox_attacks.py."""

import ctypes
import ctypes.util
import errno
import re
import struct
from pathlib import Path

import pytest

from hybridflow.tools import seccomp

ARCHES = ["x86_64", "aarch64"]
KILL, ALLOW = 0x80000000, 0x7FFF0000
EPERM, ENOSYS, EAFNOSUPPORT = 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS, 0x50000 | errno.EAFNOSUPPORT


def run_filter(program: bytes, arch: str | int, nr: int, *args: int) -> int:
    """What the kernel would do with system call ``nr`` of ``arch`` (a name, or an AUDIT_ARCH value): classic BPF
    over struct seccomp_data."""
    audit_arch = seccomp.AUDIT_ARCH[arch] if isinstance(arch, str) else arch
    data = struct.pack("<iIQ6Q", nr, audit_arch, 0, *(list(args) + [0] * 6)[:6])
    ops = [struct.unpack("=HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = ops[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x06:  # ret k
            return k
        elif code in (0x15, 0x35, 0x45):  # jeq, jge, jset
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
        pc += 1


def number(name: str, arch: str) -> int:
    table = seccomp.DENIED if name in seccomp.DENIED else seccomp.FILTERED
    return table[name][ARCHES.index(arch)]


@pytest.mark.parametrize("arch", ARCHES)
def test_every_denied_call_is_refused_and_others_allowed(arch):
    program = seccomp.program(arch)
    denied = {name: numbers[ARCHES.index(arch)] for name, numbers in seccomp.DENIED.items()}
    for name, nr in denied.items():
        if nr is not None:
            assert run_filter(program, arch, nr) == EPERM, name
    read, write, openat, mmap = {"x86_64": (0, 1, 257, 9), "aarch64": (63, 64, 56, 222)}[arch]
    for nr in (read, write, openat, mmap):
        assert run_filter(program, arch, nr) == ALLOW


@pytest.mark.parametrize("arch", ARCHES)
def test_clone_may_not_make_namespaces_and_clone3_falls_back(arch):
    program, clone = seccomp.program(arch), number("clone", arch)
    sigchld, clone_vm, clone_thread = 17, 0x100, 0x10000
    assert run_filter(program, arch, clone, sigchld) == ALLOW  # fork
    assert run_filter(program, arch, clone, clone_vm | clone_thread | 0x3D0F00) == ALLOW  # a thread
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80):
        assert run_filter(program, arch, clone, sigchld | flag) == EPERM, hex(flag)
    assert run_filter(program, arch, clone, (1 << 32) | sigchld | 0x10000000) == EPERM  # high bits change nothing
    assert run_filter(program, arch, number("clone3", arch)) == ENOSYS


@pytest.mark.parametrize("arch", ARCHES)
def test_terminal_injection_and_unusual_socket_families_are_refused(arch):
    program, ioctl = seccomp.program(arch), number("ioctl", arch)
    assert run_filter(program, arch, ioctl, 1, 0x5412) == EPERM  # TIOCSTI
    assert run_filter(program, arch, ioctl, 1, (7 << 32) | 0x5412) == EPERM  # the kernel reads an unsigned int
    assert run_filter(program, arch, ioctl, 1, 0x541C) == EPERM  # TIOCLINUX
    assert run_filter(program, arch, ioctl, 1, 0x5401) == ALLOW  # TCGETS
    for call in ("socket", "socketpair"):
        for family in (1, 2, 10):
            assert run_filter(program, arch, number(call, arch), family, 1) == ALLOW
        for family in (16, 17, 38, 40):  # netlink, packet, alg, vsock
            assert run_filter(program, arch, number(call, arch), family, 1) == EAFNOSUPPORT


def test_other_abis_are_killed():
    x86 = seccomp.program("x86_64")
    assert run_filter(x86, "x86_64", 0x40000000 | 250) == KILL  # x32 keyctl
    assert run_filter(x86, "x86_64", 0x40000000) == KILL
    i386, arm = 0x40000003, 0x40000028  # int 0x80 on x86_64, a 32-bit process on aarch64
    for nr in (0, 3, 250):
        assert run_filter(x86, i386, nr) == KILL
        assert run_filter(seccomp.program("aarch64"), arm, nr) == KILL
        assert run_filter(x86, seccomp.AUDIT_ARCH["aarch64"], nr) == KILL
    with pytest.raises(ValueError, match="riscv64"):
        seccomp.program("riscv64")


def _libseccomp():
    name = ctypes.util.find_library("seccomp")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    return lib


TOO_NEW_FOR_LIBSECCOMP = {"open_tree_attr"}  # Linux 6.15: number 467 on every arch (kernel syscall tables)


@pytest.mark.skipif(_libseccomp() is None, reason="libseccomp (libseccomp2) is not installed on this machine")
@pytest.mark.parametrize("arch", ARCHES)
def test_numbers_match_libseccomp(arch):
    lib = _libseccomp()
    for name in [*seccomp.DENIED, *seccomp.FILTERED]:
        theirs = lib.seccomp_syscall_resolve_name_arch(seccomp.AUDIT_ARCH[arch], name.encode())
        if name in TOO_NEW_FOR_LIBSECCOMP and theirs < 0:
            continue
        assert number(name, arch) == (theirs if theirs >= 0 else None), name


HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "aarch64": "/usr/include/asm-generic/unistd.h"}


@pytest.mark.parametrize("arch", ARCHES)
def test_numbers_match_the_kernel_headers(arch):
    path = Path(HEADERS[arch])
    if not path.exists():
        pytest.skip(f"{path} (linux-libc-dev) is not installed on this machine")
    defined = {m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)", path.read_text())}
    checked = 0
    for name in [*seccomp.DENIED, *seccomp.FILTERED]:
        if name in defined:
            assert number(name, arch) == defined[name], name
            checked += 1
    assert checked > 50
