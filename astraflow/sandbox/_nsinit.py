"""Init process of a namespaced sandbox run (stdlib only; executed as `python -I -S -c <source>`).

`unshare --mount --net --pid --ipc --uts --fork --kill-child` starts this as root and as pid 1 of
fresh namespaces. It makes the filesystem read-only for the run, gives it a private size-capped
tmpfs as /tmp (its working directory, filled with a copy of the host work directory), mounts a
/proc that shows only the sandbox's processes, makes the interpreter reachable for an unprivileged
user, then forks the user process: that one drops to a uid of its own (no capabilities, no new
privileges) and execs the interpreter with the prelude. This init stays root so that its
parent-death signal survives (killing `unshare` kills it) and never runs untrusted code; when the
user process exits it kills every other process of the namespace and reports the exit status as
JSON on the status descriptor. Any setup failure is reported there as {"error": ...} and the user
code never runs (fail closed).

argv[1] is a JSON object: uid, workdir (host path), disk_mb, expose (dirs the interpreter needs),
python, argv (the user process's argv), env, status_fd.
"""

import contextlib
import ctypes
import json
import os
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
PR_SET_NO_NEW_PRIVS = 38
OPTION_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
    "strictatime": MS_STRICTATIME,
}

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def mount(source, target, fstype, flags, data=None):
    def enc(s):
        return None if s is None else s.encode()

    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target} ({fstype}): {os.strerror(err)}")


def mount_points():
    """(mount point, flags to keep) of every mount in this namespace, parents first."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            keep = 0
            for opt in fields[5].split(","):
                keep |= OPTION_FLAGS.get(opt, 0)
            out.append((point, keep))
    return out


def make_read_only():
    """Remounts every mount read-only (bind remount keeps nosuid/nodev/noexec/atime flags)."""
    for point, keep in mount_points():
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        except OSError:
            if point == "/":
                raise
            # A mount hidden under a later one cannot be reached by path; its cover is remounted.
            if os.path.ismount(point):
                st = os.statvfs(point)
                if not st.f_flag & os.ST_RDONLY:
                    raise


def hidden_ancestor(path):
    """The topmost directory on `path` that other users cannot traverse, or None."""
    parts = os.path.abspath(path).strip("/").split("/")
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


def expose(paths):
    """Makes each path reachable for the unprivileged user: a tmpfs over its hidden ancestor."""
    covers = {}
    for p in paths:
        top = hidden_ancestor(p)
        if top is not None:
            covers.setdefault(top, []).append((p, os.open(p, os.O_PATH | os.O_DIRECTORY)))
    for top, items in covers.items():
        mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for p, fd in items:
            os.makedirs(p, mode=0o755, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
            mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            os.close(fd)
        mount(None, top, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def copy_tree(src_fd, dst, uid):
    """Copies the host work directory (open as `src_fd`) into `dst`, owned by `uid`."""
    for root, dirs, files, root_fd in os.fwalk(".", dir_fd=src_fd):
        target = os.path.normpath(os.path.join(dst, root))
        for d in dirs:
            os.mkdir(os.path.join(target, d), 0o700)
            os.chown(os.path.join(target, d), uid, uid)
        for name in files:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=root_fd)
            with os.fdopen(fd, "rb") as fin, open(os.path.join(target, name), "wb") as fout:
                fout.write(fin.read())
            os.chown(os.path.join(target, name), uid, uid)


def setup(cfg):
    uid = cfg["uid"]
    work_fd = os.open(cfg["workdir"], os.O_RDONLY | os.O_DIRECTORY)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    make_read_only()
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    expose(cfg["expose"])
    mount(
        "tmpfs",
        "/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={cfg['disk_mb']}m,mode=0700,uid={uid},gid={uid}",
    )
    mount(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        MS_NOSUID | MS_NODEV | MS_NOEXEC,
        f"size=1m,mode=0700,uid={uid},gid={uid}",
    )
    copy_tree(work_fd, "/tmp", uid)
    os.close(work_fd)


def run_user(cfg, status_fd):
    uid = cfg["uid"]
    os.close(status_fd)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        os._exit(125)
    os.chdir("/tmp")
    os.execve(cfg["python"], cfg["argv"], cfg["env"])


def main():
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)

    def report(obj):
        os.write(status_fd, json.dumps(obj).encode())
        os._exit(0)

    try:
        setup(cfg)
    except OSError as exc:
        report({"error": f"sandbox setup failed: {exc}"})
    child = os.fork()
    if child == 0:
        try:
            run_user(cfg, status_fd)
        finally:
            os._exit(126)
    while True:  # as pid 1, reap every orphan until the user process itself exits
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    with contextlib.suppress(ProcessLookupError):  # nothing left is fine
        os.kill(-1, signal.SIGKILL)  # from pid 1: every other process of this pid namespace
    if os.WIFSIGNALED(status):
        report({"exit_code": None, "signal": os.WTERMSIG(status)})
    report({"exit_code": os.WEXITSTATUS(status), "signal": None})


main()
