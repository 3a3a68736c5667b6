"""Bootstrap of the Python sandbox; runs as ``python -I _sandbox_child.py`` (standard library only).

Not imported by megarl: :mod:`megarl.rollout.tools.python_sandbox` starts it in a new session with a
clean environment and writes one JSON object on its stdin::

    {"code": str, "cpu_s": int, "memory_bytes": int, "max_processes": int, "max_file_bytes": int,
     "tmpfs_bytes": int, "uid": int, "isolate": bool, "fallback_workdir": str,
     "hide_paths": [str], "expose_paths": [str], "interpreter_world_readable": bool}

Process tree (each arrow is a fork)::

    bootstrap (host namespaces, own session)            <- killed as a group on timeout
      -> init  (PID 1 of a new PID namespace; reaps)    <- SIGKILL when the bootstrap dies (PDEATHSIG)
           -> user code (unprivileged uid, rlimits)     <- dies with its PID namespace

Isolation, when ``isolate`` and the kernel allows it (root, or unprivileged user namespaces):
new network namespace (only a downed loopback: no network), new mount namespace (every mount
re-bound read-only, fresh tmpfs on /tmp, /var/tmp and /dev/shm, fresh /proc showing only the
sandbox's processes), home directories covered by an empty tmpfs (the Python installation bound back
if it lives there), new PID, IPC and UTS namespaces; the user code runs under a uid of its own
(root case) so it can neither write the host's files nor signal the host's processes. Without
namespaces it degrades to rlimits + own session + clean environment + temporary directory, and says
so on stderr (``[sandbox] isolation unavailable``).

Exit status: the user code's exit status; ``128 + signal`` when it was killed by a signal; 125 when
the sandbox itself could not be set up (message on stderr, prefixed ``[sandbox]``).
"""
import ctypes
import json
import os
import resource
import signal
import sys
import traceback

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
WORKDIR = "/tmp/work"
SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    def enc(s):
        return None if s is None else s.encode()
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _unshare(as_root: bool) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if not as_root:
        # Unprivileged: a user namespace first, mapping our uid to root inside it.
        uid, gid = os.getuid(), os.getgid()
        _check(_libc.unshare(flags | CLONE_NEWUSER), "unshare")
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"0 {gid} 1")
        return
    _check(_libc.unshare(flags), "unshare")


def _hide_paths(hide: list, expose: list) -> None:
    """Cover each ``hide`` dir (home directories) with an empty tmpfs, then bind each ``expose`` dir
    that lay beneath one (the Python installation) back at its own path."""
    hide = [h for h in hide if os.path.isdir(h)]
    kept = []
    for path in expose:
        if any(path == h or path.startswith(h.rstrip("/") + "/") for h in hide):
            kept.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
    for target in hide:
        _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path, fd in kept:
        os.makedirs(path, mode=0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)


def _read_only_filesystem(cfg: dict) -> None:
    """Private mounts, home directories hidden, everything read-only, fresh writable tmpfs for the
    temp dirs, fresh /proc."""
    tmpfs_bytes = int(cfg["tmpfs_bytes"])
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _hide_paths(cfg["hide_paths"], cfg["expose_paths"])
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f]
    for target in mounts:
        # MS_REMOUNT|MS_BIND changes only this namespace's mount flags, never the superblock.
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
        try:
            _mount(None, target.encode().decode("unicode_escape"), None, flags)
        except OSError:
            pass  # a mount hidden under another, or locked flags: the uid drop still protects it
    for target in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(target):
            _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV,
                   f"size={tmpfs_bytes},mode=1777")
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _set_limits(cfg: dict) -> None:
    def limit(res, value):
        resource.setrlimit(res, (value, value))

    limit(resource.RLIMIT_CPU, int(cfg["cpu_s"]))
    limit(resource.RLIMIT_AS, int(cfg["memory_bytes"]))
    limit(resource.RLIMIT_NPROC, int(cfg["max_processes"]))
    limit(resource.RLIMIT_FSIZE, int(cfg["max_file_bytes"]))
    limit(resource.RLIMIT_CORE, 0)


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    try:
        os.setgid(uid)
        os.setuid(uid)
    except OSError:  # uid not mapped in this (container's) user namespace
        os.setgid(65534)
        os.setuid(65534)


def _run_user_code(cfg: dict, drop_to_uid: bool) -> None:
    """In the user-code process: limits, privileges, then exec the code. Never returns."""
    try:
        os.makedirs(WORKDIR, exist_ok=True)
        if drop_to_uid:
            os.chown(WORKDIR, cfg["uid"], cfg["uid"])
        os.chmod(WORKDIR, 0o700)
        os.chdir(WORKDIR)
        _set_limits(cfg)
        if drop_to_uid:
            _drop_privileges(cfg["uid"])
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    except OSError as e:
        print(f"[sandbox] setup failed: {e}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    sys.argv = ["<code>"]
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    status = 0
    try:
        exec(compile(cfg["code"], "<code>", "exec"), namespace)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # noqa: BLE001 - everything the code raises is reported to the model
        # Drop this bootstrap's own frame from the traceback the model sees.
        traceback.print_exception(type(e), e, e.__traceback__ and e.__traceback__.tb_next)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _wait_status(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _init(cfg: dict, drop_to_uid: bool) -> None:
    """PID 1 of the new namespace: set up the filesystem, fork the user code, reap, exit."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        _read_only_filesystem(cfg)
    except OSError as e:
        print(f"[sandbox] setup failed: {e}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    child = os.fork()
    if child == 0:
        _run_user_code(cfg, drop_to_uid)
    # Returning from PID 1 kills every process left in the namespace (orphans of a fork bomb too).
    os._exit(_wait_status(child))


def main() -> None:
    """The sandbox child: read its settings (JSON) from stdin, isolate itself (namespaces when it
    can, else rlimits only), run the code and exit with its status.
    """
    cfg = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    as_root = os.geteuid() == 0
    isolated = False
    if cfg["isolate"]:
        try:
            _unshare(as_root)
            isolated = True
        except OSError as e:
            print(f"[sandbox] isolation unavailable ({e}); running with rlimits only",
                  file=sys.stderr, flush=True)
    if not isolated:
        # Best effort: own session (set by the parent), rlimits, clean env, temp dir.
        os.makedirs(cfg["fallback_workdir"], exist_ok=True)
        cfg_workdir = cfg["fallback_workdir"]
        globals()["WORKDIR"] = cfg_workdir
        child = os.fork()
        if child == 0:
            # Without a mount namespace the interpreter must be readable by the sandbox uid.
            _run_user_code(cfg, drop_to_uid=as_root and cfg["interpreter_world_readable"])
        os._exit(_wait_status(child))
    child = os.fork()  # the first child of unshare(CLONE_NEWPID) is PID 1 of the new namespace
    if child == 0:
        _init(cfg, drop_to_uid=as_root)
    os._exit(_wait_status(child))


if __name__ == "__main__":
    main()
