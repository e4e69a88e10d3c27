"""The sandbox's first process: namespaces, limits and user, then the untrusted program (run by sandbox.py only).

    python -I yatt_hpc/agent/sandbox_child.py '<limits json>'   # the program's source on stdin

Standard library only, run with `-I` as a file, so nothing of the rank's environment or of yatt_hpc is imported.
It unshares a network, mount and PID namespace (as root; otherwise a user namespace with them), mounts a fresh
tmpfs on /tmp, /var/tmp and /dev/shm, forks the program's process (PID 1 of the new namespace: when it ends, the
kernel kills every process it left), which sets the resource limits, drops to an unprivileged uid and execs
Python on the program in its private directory. This process waits at most `timeout_s` and then kills it.
Exit status: the program's, 124 on timeout, 125 when the sandbox itself could not be set up (message on stderr).
"""
import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_REC, MS_PRIVATE, PR_SET_PDEATHSIG = 16384, 1 << 18, 1
TIMEOUT, SETUP_FAILED = 124, 125


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def isolate(libc, limits: dict) -> None:
    """New namespaces (network unless allowed, mount, PID) for the children of this process."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | (0 if limits["allow_network"] else CLONE_NEWNET)
    if uid != 0:
        flags |= CLONE_NEWUSER
    _check(libc.unshare(flags), "unshare")
    if uid != 0:  # be root inside the user namespace (and our own uid outside it)
        for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"0 {uid} 1"),
                           ("/proc/self/gid_map", f"0 {gid} 1")):
            with open(path, "w") as f:
                f.write(text)
    _check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    size = f"size={max(limits['file_mb'], 1) * 4}m".encode()
    for target in (b"/tmp", b"/var/tmp", b"/dev/shm"):
        if os.path.isdir(target):
            _check(libc.mount(b"tmpfs", target, b"tmpfs", 0, size), f"mount tmpfs {target.decode()}")


def become_program(libc, limits: dict, source: bytes) -> None:
    """In PID 1 of the new namespace: the private directory, the limits, the uid; then exec the program."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    work = "/tmp/work"
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "main.py"), "wb") as f:
        f.write(source)
    uid = limits["uid"]
    if os.getuid() == 0 and uid is not None:
        os.chown(work, uid, uid)
    mb = 2**20
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))  # SIGXCPU, SIGKILL 1 s on
    for what, value in ( (resource.RLIMIT_AS, limits["memory_mb"] * mb),
                        (resource.RLIMIT_FSIZE, limits["file_mb"] * mb), (resource.RLIMIT_NPROC, limits["processes"]),
                        (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 64)):
        resource.setrlimit(what, (value, value))
    os.chdir(work)
    if os.getuid() == 0 and uid is not None:  # root ignores RLIMIT_NPROC: the program runs as a uid of its own
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    os.execve(limits["python"], [limits["python"], "-I", "main.py"], env)


def main() -> int:
    limits = json.loads(sys.argv[1])
    source = sys.stdin.buffer.read()
    libc = _libc()
    try:
        if limits["isolate"]:
            isolate(libc, limits)
    except OSError as err:
        print(f"sandbox setup failed: {err}", file=sys.stderr)
        return SETUP_FAILED
    pid = os.fork()
    if pid == 0:
        try:
            become_program(libc, limits, source)
        except BaseException as err:  # noqa: BLE001 - anything before exec is the sandbox's failure
            print(f"sandbox setup failed: {type(err).__name__}: {err}", file=sys.stderr)
            os._exit(SETUP_FAILED)
    deadline = time.monotonic() + limits["timeout_s"]
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            if os.WIFEXITED(status):
                return os.waitstatus_to_exitcode(status)
            if os.WTERMSIG(status) == signal.SIGKILL and usage.ru_utime + usage.ru_stime >= limits["cpu_s"]:
                return 128 + signal.SIGXCPU  # the CPU limit's hard SIGKILL: PID 1 of a namespace ignores SIGXCPU
            return 128 + os.WTERMSIG(status)
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)  # PID 1 of the namespace: the kernel kills the rest with it
            os.waitpid(pid, 0)
            return TIMEOUT
        time.sleep(0.005)


if __name__ == "__main__":
    sys.exit(main())
