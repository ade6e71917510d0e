"""The sandbox's seccomp filter: a classic-BPF program, built here, that bubblewrap loads (``--seccomp FD``).

It denies what a tool's code never needs and what would let it reach kernel state outside the sandbox:

- keyrings (``keyctl``, ``add_key``, ``request_key``): the session keyring is inherited, setsid keeps it;
- new namespaces (``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*`` flag; ``clone3``, whose flags a filter
  cannot read, answers ENOSYS so that the C library falls back to ``clone``) and every mount call;
- other processes' memory (``ptrace``, ``process_vm_*``, ``pidfd_getfd``, ``kcmp``, ``process_madvise``);
- large kernel attack surfaces (``bpf``, ``perf_event_open``, ``userfaultfd``, io_uring) and administration
  (modules, kexec, reboot, swap, quotas, clocks, ``syslog``, file handles);
- SysV IPC and POSIX message queues (memory no file system limit bounds);
- sockets other than AF_UNIX, AF_INET and AF_INET6 (AF_VSOCK, e.g., reaches a VM's host from any network
  namespace), and the terminal-injecting ioctls TIOCSTI and TIOCLINUX.

Everything else is allowed: it is a deny list for the host's own architecture (x86_64 or aarch64); a system call
of another ABI (i386 via ``int 0x80``, x32) kills the process, so it cannot bypass the list by another number.
A denied call fails with EPERM (sockets: EAFNOSUPPORT), which the code sees as an ordinary OSError.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6] (little-endian on both arches)
NR, ARCH = 0, 4


def arg_low(i: int) -> int:
    """Offset of the low 32 bits of system call argument ``i``."""
    return 16 + 8 * i


AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000

# The denied calls with their numbers (x86_64, aarch64); None where the arch has no such call. Checked against
# libseccomp's tables in tests/tools/test_seccomp.py; open_tree_attr (6.15) is newer than those tables.
DENIED = {
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "unshare": (272, 97),
    "setns": (308, 268),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "mount_setattr": (442, 442),
    "open_tree_attr": (467, 467),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438),
    "kcmp": (312, 272),
    "process_madvise": (440, 440),
    "process_mrelease": (448, 448),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "quotactl_fd": (443, 443),
    "syslog": (103, 116),
    "lookup_dcookie": (212, 18),
    "nfsservctl": (180, 42),
    "uselib": (134, None),
    "ioperm": (173, None),
    "iopl": (172, None),
    "modify_ldt": (154, None),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "vhangup": (153, 58),
    "fanotify_init": (300, 262),
    "settimeofday": (164, 170),
    "clock_settime": (227, 112),
    "memfd_secret": (447, 447),
    "shmget": (29, 194),
    "shmat": (30, 196),
    "shmctl": (31, 195),
    "shmdt": (67, 197),
    "semget": (64, 190),
    "semop": (65, 193),
    "semctl": (66, 191),
    "semtimedop": (220, 192),
    "msgget": (68, 186),
    "msgsnd": (69, 189),
    "msgrcv": (70, 188),
    "msgctl": (71, 187),
    "mq_open": (240, 180),
    "mq_unlink": (241, 181),
    "mq_timedsend": (242, 182),
    "mq_timedreceive": (243, 183),
    "mq_notify": (244, 184),
    "mq_getsetattr": (245, 185),
}
# Calls allowed with some arguments only.
CLONE, CLONE3, IOCTL, SOCKET, SOCKETPAIR = "clone", "clone3", "ioctl", "socket", "socketpair"
FILTERED = {CLONE: (56, 220), CLONE3: (435, 435), IOCTL: (16, 29), SOCKET: (41, 198), SOCKETPAIR: (53, 199)}

# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
SOCKET_FAMILIES = (1, 2, 10)  # AF_UNIX, AF_INET, AF_INET6

RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
LD_ABS_W, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ...|JGE|K, ...|JSET|K


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter, in the kernel's byte order


def _deny(nr: int, action: int) -> list[bytes]:
    """If the call is ``nr``: return ``action``; else go on (the accumulator still holds the call's number)."""
    return [_op(JEQ, nr, 0, 1), _op(RET, action)]


def _unless(nr: int, offset: int, test: list[tuple[int, int]], action: int) -> list[bytes]:
    """If the call is ``nr``: load the 32-bit argument at ``offset``; return ``action`` if any of ``test``
    (a JEQ or JSET opcode, a constant) matches, else allow. Other calls skip the block."""
    body = [_op(LD_ABS_W, offset)]
    for i, (code, k) in enumerate(test):
        body.append(_op(code, k, len(test) - i, 0))  # a match jumps to the action, past the allow
    body += [_op(RET, RET_ALLOW), _op(RET, action)]
    return [_op(JEQ, nr, 0, len(body)), *body]


def program(arch: str | None = None) -> bytes:
    """The filter for ``arch`` (this machine's, by default) as bwrap reads it: struct sock_filter[]."""
    arch = arch or platform.machine()
    if arch not in AUDIT_ARCH:
        raise ValueError(f"no seccomp filter for {arch!r}: only {sorted(AUDIT_ARCH)}")
    column = 0 if arch == "x86_64" else 1
    eperm = RET_ERRNO | errno.EPERM
    code = [_op(LD_ABS_W, ARCH), _op(JEQ, AUDIT_ARCH[arch], 1, 0), _op(RET, RET_KILL_PROCESS), _op(LD_ABS_W, NR)]
    if arch == "x86_64":
        code += [_op(JGE, X32_SYSCALL_BIT, 0, 1), _op(RET, RET_KILL_PROCESS)]
    for numbers in DENIED.values():
        if numbers[column] is not None:
            code += _deny(numbers[column], eperm)
    number = {name: numbers[column] for name, numbers in FILTERED.items()}
    code += _deny(number[CLONE3], RET_ERRNO | errno.ENOSYS)
    code += _unless(number[CLONE], arg_low(0), [(JSET, CLONE_NEW_FLAGS)], eperm)
    code += _unless(number[IOCTL], arg_low(1), [(JEQ, TIOCSTI), (JEQ, TIOCLINUX)], eperm)
    for name in (SOCKET, SOCKETPAIR):  # allowed families: a match jumps to "allow", anything else is refused
        families = [_op(JEQ, family, len(SOCKET_FAMILIES) - i, 0) for i, family in enumerate(SOCKET_FAMILIES)]
        body = [_op(LD_ABS_W, arg_low(0)), *families, _op(RET, RET_ERRNO | errno.EAFNOSUPPORT), _op(RET, RET_ALLOW)]
        code += [_op(JEQ, number[name], 0, len(body)), *body]
    code.append(_op(RET, RET_ALLOW))
    return b"".join(code)
