"""sandbox.py: the code interpreter of multi-turn tool-use rollouts. The model writes Python, this
runs it, and the text the model sees in its tool turn comes back.

    cfg = config.SandboxConfig(timeout_s=10)
    results = sandbox.run_batch(codes, cfg)   # in order, cfg.max_workers at a time
    turn = sandbox.format_result(results[0])  # the output, then an "Error: ..." line if it failed
    result = sandbox.run_code("print(1)")     # one execution, with config.SandboxConfig()
    sandbox.isolation()                       # "namespaces" or "process": what this machine allows

    echo 'import os; print(os.getppid())' | python sandbox.py   # prints "0" under "namespaces"

Each execution is a fresh interpreter in a private directory, isolated by Linux user namespaces
("namespaces") or, where those are forbidden, best effort ("process"); not a virtual machine. What
each mode guarantees, the limits and the Result.error values: docs/sandbox.md.
"""

import contextlib
import ctypes
import dataclasses
import functools
import json
import os
import re
import resource
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings

_THIS_FILE = os.path.abspath(__file__)
_NOBODY = 65534  # the identity code runs under when the trainer is root
_EXIT_SYNTAX, _EXIT_EXCEPTION, _EXIT_MEMORY, _EXIT_SETUP = 211, 212, 213, 214  # the runner's
_STOP_GRACE_S = 2.0  # after a timeout, the launcher's time to clean up before it is SIGKILLed
# how long each clean-up (the launcher's, then the trainer's) kills the run's processes; then the
# run ends as a "sandbox" failure
_KILL_S = 1.5


@dataclasses.dataclass
class Result:
    output: str  # stdout+stderr as the model sees it (controls removed, cut in the middle if long)
    ok: bool  # the code exited with status 0 in time
    # "" if ok, else timeout | cpu | memory | syntax | exception | exit_code | killed | sandbox
    error: str
    message: str  # one line describing the error, "" if ok (deterministic: no timings, no paths)
    # the process status: >= 0 an exit code, < 0 a signal; None if killed at timeout
    exit_code: int | None
    duration_s: float  # wall clock of the whole execution
    truncated: bool  # output was cut to max_output_bytes
    output_bytes: int  # bytes the code wrote in total


def format_result(result: Result) -> str:
    """The tool turn's text: the output, then one error line if the run failed ("(no output)" if
    there is none)."""
    text = result.output
    if result.ok:
        return text if text else "(no output)"
    if text and not text.endswith("\n"):
        text += "\n"
    return text + result.message


def _default_config():
    """config.SandboxConfig(), imported here: this file also runs alone as the launcher and the
    runner (`python -I -S sandbox.py`), out of the project's reach."""
    from config import SandboxConfig

    return SandboxConfig()


def run_batch(codes: list[str], config=None) -> list[Result]:
    """Run every code, at most config.max_workers at a time (one thread per subprocess); results in
    input order."""
    from concurrent.futures import ThreadPoolExecutor

    config = config or _default_config()
    if not codes:
        return []
    isolation(config)  # probe once, before the threads race for it
    with ThreadPoolExecutor(
        max_workers=min(config.max_workers, len(codes)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda code: run_code(code, config), codes))


def run_code(code: str, config=None) -> Result:
    """Run one piece of code in a fresh sandbox; never raises, returns within about timeout_s."""
    global _last_failure
    config = config or _default_config()
    try:
        result = _run(code, config, isolation(config))
    except Exception as e:  # a sandbox bug or a machine problem; the trainer carries on
        result = Result("", False, "sandbox", f"Error: sandbox failure ({type(e).__name__}: {e})",
                        None, 0.0, False, 0)
    if result.error == "sandbox":
        _last_failure = result.message
    return result


_last_failure = None  # the message of this process's latest "sandbox" failure


def last_failure():
    """The message of this process's latest failure of the sandbox itself (Result.error
    "sandbox"), or None: what a run that stops on them names."""
    return _last_failure


class Unavailable(RuntimeError):
    """The configured isolation cannot run here. The message is one line for the user: what
    failed and what to set."""


_MODES: dict[tuple, str] = {}
_MODES_LOCK = threading.Lock()
_PROBE_RETRY_S = 1.0  # between the two probes of "auto"


def isolation(config=None) -> str:
    """The mode run_code uses for this config: "namespaces" or "process", decided once per process
    and kept ("auto": docs/sandbox.md, "Modes"). Unavailable, and nothing kept, where the mode
    cannot run here: two failed probes without allow_process_fallback, or (_out_of_reach) a
    "process" mode whose unprivileged user cannot reach the interpreter."""
    config = config or _default_config()
    key = (config.isolation, _python(config), config.network, config.allow_process_fallback,
           config.tmp_root)
    with _MODES_LOCK:
        if key not in _MODES:
            _MODES[key] = _choose_mode(config)
        return _MODES[key]


def _choose_mode(config):
    mode = config.isolation
    if mode == "auto":
        said = _probe(config)
        if said is not None:  # one transient failure must not decide a whole run
            time.sleep(_PROBE_RETRY_S)
            said = _probe(config)
        failed = f"sandbox: user namespaces failed twice here (the probe said: {said}); "
        if said is None:
            mode = "namespaces"
        elif not config.allow_process_fallback:
            raise Unavailable(failed + "set sandbox.allow_process_fallback=true (or sandbox."
                              "isolation=process) to run tool code in the weaker 'process' mode "
                              "(docs/sandbox.md)")
        else:
            mode = "process"
            warnings.warn(failed + "as sandbox.allow_process_fallback allows, tool code runs in "
                          "the weaker 'process' mode (docs/sandbox.md)", stacklevel=3)
    if mode == "process" and os.geteuid() == 0:
        problem = _out_of_reach(_python(config), _view(_python(config), config.network),
                                config.tmp_root or tempfile.gettempdir())
        if problem:
            raise Unavailable(problem)
    return mode


def _probe(config):
    """None if "namespaces" runs print() here, else what it said instead (one line)."""
    probe = dataclasses.replace(config, timeout_s=30.0, cpu_s=10,
                                memory_mb=max(config.memory_mb, 256))
    try:
        said = format_result(_run("print('sandbox ok')", probe, "namespaces"))
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    return None if said == "sandbox ok\n" else " ".join(said.split())


def _out_of_reach(python, view, tmp_root):
    """Under a root trainer, "process" mode runs the code as a user of its own, for whom only the
    permissions of "others" count: the first directory on the way to the interpreter, its
    libraries or tmp_root that others cannot enter, as one line saying what to set; else None."""
    paths = [(p, "python") for p in [python, os.path.realpath(python)] + [
        source for source, _ in view["binds"]]] + [(tmp_root, "tmp_root")]
    for path, key in paths:
        parts = path.split("/")
        for depth in range(2, len(parts) + 1):
            directory = "/".join(parts[:depth])
            mode = os.stat(directory).st_mode
            if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
                advice = ("an interpreter outside it (e.g. /usr/bin/python3)" if key == "python"
                          else "a directory every user can enter")
                return (f"sandbox: 'process' mode runs the code as an unprivileged user, who "
                        f"cannot reach {path} ({directory} is {stat.S_IMODE(mode):o}); set "
                        f"sandbox.{key} to {advice}")
    return None


# --------------------------------------------------------------------------------------------------
# The trainer side: start the launcher, read its output with a bound, kill its process group,
# classify.
# --------------------------------------------------------------------------------------------------

def _python(config):
    return os.path.abspath(shutil.which(config.python or sys.executable) or config.python)


_RUNNER = "/sandbox/sandbox.py"  # "namespaces" mode: the runner's path inside (a copy of this file)
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # libraries, tools
# The few files of /etc an interpreter and its libraries read: the loader's cache, the time zone,
# the name-service switch (no passwd: a two-line one is written), certificates; with network=True
# the resolver's too.
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "nsswitch.conf",
        "protocols", "services", "mime.types", "alternatives", "ssl/certs", "ssl/openssl.cnf",
        "ca-certificates")
_ETC_NETWORK = ("resolv.conf", "hosts", "host.conf", "gai.conf")


@functools.cache
def _view(python, network):
    """What the sandbox shows of the host's files: {"python": the interpreter's path there,
    "binds": [[host path, path inside], ...] (read-only), "links": {path inside: symlink target}}.
    "namespaces" mode builds its root from it, "process" mode its Landlock rules. Asks the
    interpreter once for its prefixes and sys.path (site's .pth files included, as the runner sees
    them)."""
    # The interpreter by its real directory: a venv reached through a symlink (a checkout's .venv)
    # then needs no path of that checkout. Not its real file: a venv's python is a symlink itself.
    inside = os.path.join(os.path.realpath(os.path.dirname(python)), os.path.basename(python))
    probe = ("import json, sys; "
             "print(json.dumps([sys.base_prefix, sys.base_exec_prefix, *sys.path]))")
    said = subprocess.run([inside, "-I", "-c", probe], capture_output=True, text=True, timeout=60,
                          cwd="/", env={"LANG": "C.UTF-8"}, check=True).stdout
    bin_dir = os.path.dirname(inside)
    venv_files = [os.path.join(d, "pyvenv.cfg") for d in (bin_dir, os.path.dirname(bin_dir))]
    wanted = [*json.loads(said), bin_dir, os.path.dirname(os.path.realpath(inside)), *venv_files]
    links = {p: os.readlink(p) for p in _SYSTEM_DIRS if os.path.islink(p)}
    wanted += [p for p in _SYSTEM_DIRS if p not in links]
    kept = []  # real paths, none inside another, nor "/" (the whole host)
    for real in sorted({os.path.realpath(p) for p in wanted if p and os.path.exists(p)} - {"/"}):
        if not any(real.startswith(k + "/") for k in kept):
            kept.append(real)
    binds = [[p, p] for p in kept]
    for name in _ETC + (_ETC_NETWORK if network else ()):
        if os.path.exists(f"/etc/{name}"):
            binds.append([os.path.realpath(f"/etc/{name}"), f"/etc/{name}"])
    return {"python": inside, "binds": binds, "links": links}


def _run(code, config, mode):
    start = time.monotonic()
    python = _python(config)
    view = _view(python, config.network)
    workdir = outer = None
    if mode == "process":
        # The code's directory inside one of the trainer's that the code cannot write (0711): it
        # cannot rename its directory and leave a symlink for the clean-up to follow.
        outer = tempfile.mkdtemp(prefix="stare-sandbox-", dir=config.tmp_root or None)
        outer_fd = os.open(outer, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        os.chmod(outer_fd, 0o711)
        workdir = os.path.join(outer, "work")
        os.mkdir("work", 0o700, dir_fd=outer_fd)
    home = workdir or "/tmp"
    bin_dir = os.path.dirname(view["python"] if mode == "namespaces" else python)
    env = {"PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home,
           "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    cgroup = _new_cgroup() if mode == "process" and os.geteuid() == 0 else None
    spec = {"mode": mode, "python": python, "workdir": workdir, "cgroup": cgroup,
            "landlock_abi": _landlock_abi() if mode == "process" else 0,
            "network": config.network, "trainer_pid": os.getpid(), "cpu_s": int(config.cpu_s),
            "memory_mb": int(config.memory_mb), "max_processes": int(config.max_processes),
            "max_file_mb": int(config.max_file_mb), "view": view}
    proc = None
    try:
        # the launcher reads the code from stdin, then closes it
        with tempfile.TemporaryFile() as code_file:
            code_file.write(code.encode("utf-8", "replace"))
            code_file.seek(0)
            proc = subprocess.Popen(
                [python, "-I", "-S", "-B", _THIS_FILE, "--launch", json.dumps(spec)],
                stdin=code_file, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd="/",
                start_new_session=True, close_fds=True)
        head, tail, total, timed_out = _read_bounded(proc.stdout.fileno(), start + config.timeout_s,
                                                     config.max_output_bytes)
        if timed_out:  # ask the launcher to kill and reap everything, then give it a moment
            os.kill(proc.pid, signal.SIGTERM)
            stop_deadline = time.monotonic() + _STOP_GRACE_S
            while (os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
                   and time.monotonic() < stop_deadline):  # exited, not reaped (see below)
                time.sleep(0.01)
    finally:
        if proc is not None:
            # Before reaping the launcher, so that its pid (the group's id) cannot have been reused:
            # normally a no-op, else it kills the launcher and what is left in its group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            # Exited but not reaped: its pid, and so the run's user (_run_user), is no other run's
            # while what the launcher did not finish is killed and /dev/shm is cleaned.
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        try:
            user = _own(_run_user(proc.pid)) if proc is not None and mode == "process" else None
            survived = not _kill_run(cgroup, user, time.monotonic() + _KILL_S, launcher=False)
            if user is not None:
                _remove_owned("/dev/shm", user)
        finally:
            if proc is not None:
                proc.wait()
                proc.stdout.close()
        if outer is not None:
            try:  # by names relative to open directories: nothing the code made is followed
                _clear(outer_fd)
            finally:
                os.close(outer_fd)
            os.rmdir(outer)  # the trainer's own directory: the code could not rename it
    output, truncated = _join_output(head, tail, total, config.max_output_bytes)
    status = None if timed_out else proc.returncode
    error, message = _classify(status, output, config)
    if survived:
        error, message = "sandbox", "Error: sandbox failure (processes of the run survived it)"
    return Result(
        output, error == "", error, message, status, time.monotonic() - start, truncated, total)


def _read_bounded(fd, deadline, limit):
    """Read fd to EOF or the deadline, keeping the first `limit` bytes and the last limit/2; returns
    (head, tail, total bytes, timed_out). Memory stays O(limit) however much the child writes."""
    head, tail, total, half = bytearray(), bytearray(), 0, limit // 2
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return head, tail, total, True
            if not selector.select(remaining):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return head, tail, total, False
            total += len(chunk)
            head += chunk[:limit - len(head)]
            tail += chunk
            if len(tail) > 2 * half:
                del tail[:len(tail) - half]


def _join_output(head, tail, total, limit):
    if total <= limit:
        return _text(head), False
    keep_tail = limit // 2
    return (_text(head[:limit - keep_tail])
            + f"\n[... {total - limit} bytes of output omitted ...]\n"
            + _text(bytes(tail[len(tail) - keep_tail:]))), True


# Terminal escape sequences: CSI (ESC [ or its one-byte form), strings (OSC, DCS, ...: to BEL, ST or
# the end of the line), and the two-character kind (ESC 7, ESC ( B).
_ESCAPES = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
                      r"|\x1b[\]PX^_][^\x07\x1b\n]*(?:\x07|\x1b\\)?"
                      r"|\x1b[ -/]*[0-~]?")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 but \t and \n, DEL, C1


def _text(data):
    r"""The code's bytes as the model's text: invalid UTF-8 as U+FFFD, \r\n and a lone \r (a
    progress bar's redraw) as \n, escape sequences and every other control character removed; \t and
    \n stay."""
    text = data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROLS.sub("", _ESCAPES.sub("", text))


def _classify(status, output, config):
    if status is None:
        return "timeout", f"Error: timed out after {config.timeout_s:g} s (the code was killed)"
    if status == 0:
        return "", ""
    if status == -signal.SIGXCPU:
        return "cpu", f"Error: CPU time limit of {config.cpu_s} s exceeded (the code was killed)"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:  # a real-time signal
            name = f"signal {-status}"
        return "killed", f"Error: the code was killed by {name}"
    if status == _EXIT_SYNTAX:
        return "syntax", "Error: the code has a syntax error"
    if status == _EXIT_EXCEPTION:
        return "exception", "Error: uncaught exception"
    if status == _EXIT_MEMORY:
        return "memory", f"Error: out of memory (limit {config.memory_mb} MB per process)"
    if status == _EXIT_SETUP:
        lines = output.strip().splitlines()
        return "sandbox", f"Error: sandbox failure ({lines[-1] if lines else 'no message'})"
    return "exit_code", f"Error: the code exited with status {status}"


_MAX_DEPTH = 32  # "process" clean-up: deeper directories are moved up first (see _clear)


def _clear(top):
    """Empty the directory open as fd `top`, whatever permissions the code left inside: each entry
    by its name relative to an open directory, a symlink removed and never followed, a directory
    opened with O_NOFOLLOW. Iterative; a directory deeper than _MAX_DEPTH is moved up into `top`
    first, so neither the stack nor the open files grow with the depth of the tree."""
    names = os.listdir(top)  # grows as deep directories move up
    stack, moved = [(top, iter(names), None)], 0
    while stack:
        fd, entries, own_name = stack[-1]
        name = next(entries, None)
        if name is None:  # fd is empty now
            stack.pop()
            if stack:
                os.close(fd)
                os.rmdir(own_name, dir_fd=stack[-1][0])
        elif not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=fd)
        elif len(stack) > _MAX_DEPTH:
            moved += 1
            new_name = f".stare-deep-{moved}-{time.time_ns()}"
            os.rename(name, new_name, src_dir_fd=fd, dst_dir_fd=top)
            names.append(new_name)
        else:
            sub = _open_directory(fd, name)
            stack.append((sub, iter(os.listdir(sub)), name))


def _open_directory(parent, name):
    """The directory `name` in the open directory `parent`, made 0700 and opened for reading;
    never through a symlink (O_NOFOLLOW), and the chmod reaches that very inode (O_PATH)."""
    path_fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                      dir_fd=parent)
    try:
        os.chmod(f"/proc/self/fd/{path_fd}", 0o700)
        return os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(path_fd)


def _remove_owned(directory, uid):
    """Remove every entry of `directory` (/dev/shm) that user `uid` owns, trees included."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in os.listdir(fd):
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if info.st_uid != uid:
                continue
            if stat.S_ISDIR(info.st_mode):
                sub = _open_directory(fd, name)
                try:
                    _clear(sub)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def _new_cgroup():
    """A new cgroup (v2) below the trainer's own, for one "process" run under a root trainer: its
    path, or None where this machine allows none (no cgroup2 mount, read-only, not root)."""
    parent = _cgroup_parent()
    try:  # a unique name, even beside one a killed trainer left
        return parent and tempfile.mkdtemp(prefix="stare-sandbox-", dir=parent)
    except OSError:
        return None


@functools.cache
def _cgroup_parent():
    """The trainer's own cgroup directory in the cgroup2 hierarchy, if a child can be made there
    (and killed as a whole: cgroup.kill, Linux 5.14+); else None."""
    with open("/proc/self/cgroup") as f:
        own = next((line[3:].strip() for line in f if line.startswith("0::")), None)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    # fields: id, parent, device, root, mount point, options..., "-", type, source, options
    points = [m[4] for m in mounts if m[m.index("-") + 1] == "cgroup2" and m[3] == "/"]
    if own is None or not points:
        return None
    parent = points[0] + own.rstrip("/")
    try:  # a process moved in and killed as a run's would be (a controller may forbid the move)
        probe = tempfile.mkdtemp(prefix="stare-sandbox-probe-", dir=parent)
    except OSError:
        return None
    sleeper = subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(60)"],
                               stdin=subprocess.DEVNULL)
    try:
        _write(f"{probe}/cgroup.procs", str(sleeper.pid))
        _write(f"{probe}/cgroup.kill", "1")
        sleeper.wait(timeout=10)
        return parent
    except (OSError, subprocess.TimeoutExpired):
        return None
    finally:
        sleeper.kill()
        sleeper.wait()
        with contextlib.suppress(OSError):
            os.rmdir(probe)


_RUN_IDS = 0x70000000  # "process" mode, root trainer: the code's uid and gid, + the launcher's pid


def _run_user(launcher_pid):
    """"process" mode: the uid (also the gid) the code runs as. Under a root trainer one of the
    run's own, _RUN_IDS + the launcher's pid (a range no distribution allocates), or `nobody` where
    the user namespace maps no such id (docs/sandbox.md, "Modes"); None under a non-root trainer:
    the code keeps its user."""
    if os.geteuid() != 0:
        return None
    run_id = _RUN_IDS + launcher_pid
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/self/{name}") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
        if not any(first <= run_id < first + count for first, _, count in ranges):
            return _NOBODY
    return run_id


def _own(user):
    """The run's user if it is the run's alone (not `nobody`, not the trainer's), else None."""
    return None if user in (None, _NOBODY) else user


# --------------------------------------------------------------------------------------------------
# The sandbox side: everything below runs in the launcher and its children, never in the trainer.
# --------------------------------------------------------------------------------------------------

# clone()'s flags that make namespaces (NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET):
# C unshares them all (but NEWNET if network=True), the seccomp filter denies them to the code
_CLONE_NAMESPACES, _CLONE_NEWNET = 0x7E020000, 0x40000000
_MNT_DETACH = 2
_NR_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}  # glibc has no wrapper
_NEW_ROOT = "/tmp"  # where C builds the sandbox's root, later PID 2's "/": any directory does
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_NOATIME = 1, 2, 4, 8, 32, 1 << 10
_MS_NODIRATIME, _MS_BIND, _MS_REC, _MS_PRIVATE = 1 << 11, 1 << 12, 1 << 14, 1 << 18
_MS_RELATIME, _MS_STRICTATIME = 1 << 21, 1 << 24
_MOUNT_OPTION_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
                       "noatime": _MS_NOATIME, "nodiratime": _MS_NODIRATIME,
                       "relatime": _MS_RELATIME}
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_SECCOMP = 1, 24, 22
_PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 36, 38
# The seccomp filter of every run (docs/sandbox.md, "The seccomp filter"). Per machine:
# the AUDIT_ARCH value the kernel reports for its native 64-bit calls; the numbers of socket,
# socketpair, clone, clone3 and keyctl; and those of the calls that always fail with EPERM: the
# keyrings (add_key, request_key, keyctl), new namespaces (unshare, setns), file watches
# (inotify_init, inotify_init1, fanotify_init), System V IPC and message queues, which outlive the
# run (shmget, semget, msgget, mq_open), and io_uring_setup (its operations include socket and
# connect, unfiltered).
_SECCOMP_SYSCALLS = {
    "x86_64": (0xC000003E, dict(socket=41, socketpair=53, clone=56, clone3=435, keyctl=250),
               (248, 249, 250, 272, 308, 253, 294, 300, 29, 64, 68, 240, 425)),
    "aarch64": (0xC00000B7, dict(socket=198, socketpair=199, clone=220, clone3=435, keyctl=219),
                (217, 218, 219, 97, 268, 26, 262, 194, 190, 186, 180, 425)),
}
_SECCOMP_SYSCALLS["riscv64"] = (0xC00000F3, *_SECCOMP_SYSCALLS["aarch64"][1:])  # the same numbers
_KEYCTL_JOIN_SESSION_KEYRING = 1
_X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: native arch value, other numbers
_SECCOMP_MODE_FILTER, _SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO, _EPERM, _ENOSYS = (
    2, 0x7FFF0000, 0x00050000, 1, 38)
_AF_UNIX, _SOCK_STREAM, _SOCK_NONBLOCK, _SOCK_CLOEXEC = 1, 1, 0o4000, 0o2000000


def _libc(name, *args):
    """Call the C library's `name`; its result, or OSError if it is negative (-1: failed)."""
    result = getattr(ctypes.CDLL(None, use_errno=True), name)(*args)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}{args}: {os.strerror(errno)}")
    return result


def _prctl(option, value):
    _libc("prctl", option, ctypes.c_ulong(value), *[ctypes.c_ulong(0)] * 3)


def _mount(source, target, fstype, flags, data=None):
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    _libc("mount", encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags),
          encode(data))


def _write(path, data):
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def _launch(spec):
    """The launcher L: the trainer's child and session leader. Start the code, wait for it, kill
    (_kill_run) whatever it left, exit as it did. SIGTERM (the trainer's deadline, or the trainer's
    death) kills the run's processes, so the wait ends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a SIGINT from the code: a death, no traceback
    code = sys.stdin.buffer.read()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    with open(_THIS_FILE, "rb") as f:  # as the trainer's user: "namespaces" mode copies it inside
        runner = f.read()
    user = _own(_run_user(os.getpid())) if spec["mode"] == "process" else None
    try:
        signal.signal(signal.SIGTERM, _stop)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # if the trainer dies, the run dies (and below)
        if os.getppid() != spec["trainer_pid"]:
            raise RuntimeError("the trainer is gone")
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # orphans of the run, setsid() or not, become ours
        # what an earlier run of this user left (none should) must not meet this one
        if user is not None and not _kill_run(None, user, time.monotonic() + _KILL_S):
            raise RuntimeError(f"processes of an earlier run under uid {user} survive")
        child = (_start_in_namespaces(code, runner, spec) if spec["mode"] == "namespaces"
                 else _start_as_process(code, spec))
        _, status = os.waitpid(child, 0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up below runs to its end
    except BaseException as e:  # noqa: B036 - _Stopped too: whatever happened, clean up
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"sandbox launcher: {type(e).__name__}: {e}", flush=True)
        status = _EXIT_SETUP << 8
    if not _kill_run(spec["cgroup"], user, time.monotonic() + _KILL_S):
        print("sandbox launcher: processes of the run survived its clean-up", flush=True)
        status = _EXIT_SETUP << 8
    _exit_like(status)


class _Stopped(Exception):
    """L's SIGTERM: the trainer's deadline passed, or the trainer died."""


def _stop(signum, frame):
    raise _Stopped("stopped")


def _kill_run(cgroup, user, deadline, launcher=True):
    """SIGKILL every process of the run until none is left: True, or False if some still live at
    the deadline. The run's processes: its cgroup's, else its own user's, else the launcher's
    children (docs/sandbox.md, "Nothing outlives a run"); a cgroup is removed once empty. Never
    blocks on a process: a zombie only its tracer may reap is released when the tracer dies. The
    trainer (launcher=False) calls it after the launcher, neither forking nor reaping."""
    helpers = set()  # until reaped: one still root when /proc is read must not be missed
    while True:
        found = []
        if cgroup is not None:
            with contextlib.suppress(FileNotFoundError):
                _write(f"{cgroup}/cgroup.kill", "1")
        elif user is not None:
            found = _processes_of(user)
            if found and launcher:
                helpers.add(_kill_all_as(user))
        elif launcher:
            found = _children_of(os.getpid())
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while launcher and (pid := os.waitpid(-1, os.WNOHANG)[0]):  # reap without waiting
                helpers.discard(pid)
        if cgroup is not None:
            try:
                with open(f"{cgroup}/cgroup.events") as f:
                    alive = "populated 1" in f.read().splitlines()
            except FileNotFoundError:  # removed: empty
                alive = False
        elif user is not None:
            alive = bool(helpers) or _processes_of(user) != []
        else:  # a zombie child left is one its tracer holds
            alive = launcher and _children_of(os.getpid()) != []
        if not alive:
            if cgroup is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(cgroup)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _kill_all_as(user):
    """kill(-1, SIGKILL) from a child of L that takes the run's user: every process of that user
    but the child, in one pass no fork escapes. The child cannot be traced (a change of user made
    it non-dumpable); it is reaped with the run's orphans. Returns its pid."""
    helper = os.fork()
    if helper == 0:
        try:
            os.setgroups([])
            os.setresgid(user, user, user)
            os.setresuid(user, user, user)
            if os.getresuid() == (user,) * 3 and user != 0:  # never as root: that is the host
                os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    return helper


_STATUS = re.compile(rb"\nState:\s*(\S).*?\nPPid:\s*(\d+).*?\nUid:([^\n]*).*?\nThreads:\s*(\d+)",
                     re.DOTALL)


def _processes():
    """(pid, state, parent's pid, uids: [real, effective, saved, file-system], threads) of every
    process in /proc."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                state, ppid, uids, threads = _STATUS.search(f.read()).groups()
        except (OSError, AttributeError):  # gone meanwhile
            continue
        yield int(pid), state, int(ppid), [int(uid) for uid in uids.split()], int(threads)


def _processes_of(uid):
    """Pids of the live processes with uid as their real, effective, saved or file-system uid (a
    zombie is not live, unless its threads are)."""
    return [pid for pid, state, _, uids, threads in _processes()
            if uid in uids and (state != b"Z" or threads > 1)]


def _children_of(parent):
    """Pids of the processes whose parent is `parent`, zombies included."""
    return [pid for pid, _, ppid, _, _ in _processes() if ppid == parent]


def _exit_like(status):
    """Exit with the same status as a child: the same code, or death by the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # only if the signal did not kill us (it always should)
    os._exit(os.waitstatus_to_exitcode(status))


def _child(function, *args):
    """fork(); the child runs function and never returns into its parent's code."""
    pid = os.fork()
    if pid:
        return pid
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # L's handler is L's alone
        function(*args)
    except BaseException as e:  # noqa: B036 - the child must exit here, whatever happened
        print(f"sandbox setup: {type(e).__name__}: {e}", flush=True)
        os._exit(_EXIT_SETUP)
    os._exit(0)


def _start_as_process(code, spec):
    """ "process" mode: the code process P is L's child, in L's process group; returns its pid."""
    os.chdir(spec["workdir"])  # in the trainer's 0711 directory, made for this run
    _write("main.py", code)
    user = _run_user(os.getpid())
    spec = {**spec, "run_user": user}
    if user is not None:
        os.chown(".", user, user)
        os.chown("main.py", user, user)

    def code_process():
        if spec["cgroup"]:  # all it starts stays there: its user cannot write the cgroup's files
            _write(f"{spec['cgroup']}/cgroup.procs", str(os.getpid()))
        if user is not None:  # root is exempt from RLIMIT_NPROC and can write anywhere
            os.setgroups([])
            os.setresgid(user, user, user)
            os.setresuid(user, user, user)
        os.umask(0o077)  # what it writes to /dev/shm is not another run's to read
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # if L dies (the code can clear this)
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # setuid grants nothing; a non-root user may add a filter
        # RLIMIT_NPROC counts the processes + threads of this real uid (initial user namespace)
        tasks = sum(threads for _, _, _, uids, threads in _processes() if uids[0] == os.getuid())
        _set_limits(spec, nproc=tasks + spec["max_processes"])
        _restrict_files(spec)
        _exec_runner(spec, spec["python"], _THIS_FILE)
    return _child(code_process)


# Landlock ("process" mode): the rights of path_beneath rules (<linux/landlock.h>) and the syscall
# numbers, the same on every architecture.
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR, _LL_TRUNCATE = 1, 2, 4, 8, 1 << 14
_LL_ALL_ABI1 = 0x1FFF  # every right of ABI 1: read, write, execute, list, make and remove
_NR_LANDLOCK_CREATE_RULESET, _NR_LANDLOCK_ADD_RULE, _NR_LANDLOCK_RESTRICT_SELF = 444, 445, 446


def _landlock_abi():
    """The kernel's Landlock ABI version; 0 where there is none (an old kernel, not enabled, or
    refused by seccomp)."""
    try:
        return _landlock(_NR_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                         ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    except OSError:
        return 0


def _restrict_files(spec):
    """ "process" mode, where Landlock exists: the code may open only what docs/sandbox.md lists
    ("Modes", Landlock); the rest is EACCES whatever its permissions."""
    abi = spec["landlock_abi"]  # the trainer's reading
    if abi == 0:
        return  # best effort: the mode's documented fallback
    handled = _LL_ALL_ABI1 | (_LL_TRUNCATE if abi >= 3 else 0)
    device = _LL_READ_FILE | _LL_WRITE_FILE | (handled & _LL_TRUNCATE)
    file_rights = _LL_EXECUTE | device
    read = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
    rules = [(source, read) for source, _ in spec["view"]["binds"]] + [(_THIS_FILE, read)]
    rules += [(spec["workdir"], handled)]
    if spec["run_user"] not in (None, _NOBODY):  # a user of its own: cleaned afterwards
        rules += [("/dev/shm", handled)]  # multiprocessing's semaphores
    rules += [(f"/dev/{name}", device) for name in ("null", "zero", "full", "random", "urandom")]
    ruleset = _landlock(_NR_LANDLOCK_CREATE_RULESET, struct.pack("=Q", handled), ctypes.c_size_t(8),
                        ctypes.c_uint32(0))
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            rights &= file_rights  # a file takes only file rights
        _landlock(_NR_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1),  # PATH_BENEATH
                  struct.pack("=Qi", rights, fd), ctypes.c_uint32(0))
        os.close(fd)
    _landlock(_NR_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    os.close(ruleset)


def _landlock(nr, *args):
    return _libc("syscall", ctypes.c_long(nr), *args)


def _start_in_namespaces(code, runner, spec):
    """"namespaces" mode: fork the namespace owner C and write its uid/gid maps from out here (only
    the parent namespace can map `nobody` for a root trainer); C does the rest in
    _inside_namespaces. Returns C's pid."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    uid, gid = os.geteuid(), os.getegid()

    def owner():
        os.close(ready_r)
        os.close(go_w)
        os.setpgid(0, 0)  # a group of its own: kill(0, ...) from the code cannot reach L
        if uid == 0:  # no supplementary groups (a non-root user cannot drop them; they stay)
            os.setgroups([])
        _libc("unshare", _CLONE_NAMESPACES & ~(_CLONE_NEWNET if spec["network"] else 0))
        os.write(ready_w, b"u")
        if os.read(go_r, 1) != b"m":
            raise RuntimeError("the launcher could not write the uid/gid maps")
        # uid 0 inside: `nobody` outside for a root trainer, else the trainer's user
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        _inside_namespaces(code, runner, spec)

    pid = _child(owner)
    os.close(ready_w)
    os.close(go_r)
    if os.read(ready_r, 1) == b"u":
        try:
            # 0 inside = nobody outside. Root mapped (as 1) only so that C can reach the
            # interpreter through root's directories (/root/.pyenv) to bind it; the code has no
            # capability at all.
            maps = ({"uid_map": f"0 {_NOBODY} 1\n1 0 1\n", "gid_map": f"0 {_NOBODY} 1\n1 0 1\n"}
                    if uid == 0 else
                    {"setgroups": "deny", "uid_map": f"0 {uid} 1\n", "gid_map": f"0 {gid} 1\n"})
            for name, text in maps.items():
                _write(f"/proc/{pid}/{name}", text)
            os.write(go_w, b"m")
        except OSError as e:
            print(f"sandbox launcher: {e}", flush=True)
    os.close(go_w)
    os.close(ready_r)
    return pid


def _inside_namespaces(code, runner, spec):
    """C: build the sandbox's root (a tmpfs with read-only binds of what the interpreter needs, a
    private tmpfs on /tmp, a few devices), start PID 1 and the code (PID 2, which moves into that
    root), wait for the code, kill PID 1 (the kernel then kills everything left in the namespace),
    exit as the code did."""
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done here propagates back to the host
    view = spec["view"]
    # Opened first, as the new root's tmpfs may cover them (a host /tmp); fds of this mount
    # namespace, as a bind's source must be. None reaches PID 1 or survives the exec.
    held = [(os.open(src, os.O_PATH | os.O_CLOEXEC), target) for src, target in view["binds"]]
    root = _NEW_ROOT
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,nr_inodes=4096,mode=0755")
    os.mkdir(f"{root}/tmp")
    _mount("tmpfs", f"{root}/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={spec['max_file_mb']}m,nr_inodes=16384,mode=0755")
    for path, target in view["links"].items():
        os.symlink(target, root + path)
    for fd, target in sorted(held, key=lambda held: held[1]):
        where = root + target
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(where, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(where), exist_ok=True)
            open(where, "a").close()
        _mount(f"/proc/self/fd/{fd}", where, None, _MS_BIND | _MS_REC)  # read-only in PID 2
        os.close(fd)
    os.makedirs(f"{root}/dev/shm")
    _mount(f"{root}/tmp", f"{root}/dev/shm", None, _MS_BIND)  # multiprocessing's semaphores
    for name in ("null", "zero", "full", "random", "urandom"):
        if os.path.exists(f"/dev/{name}"):
            open(f"{root}/dev/{name}", "w").close()
            _mount(f"/dev/{name}", f"{root}/dev/{name}", None, _MS_BIND)
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{fd}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    os.makedirs(f"{root}/etc", exist_ok=True)
    # who uid 0 is (getpass, ~); no user of the host
    _write(f"{root}/etc/passwd", "root:x:0:0:root:/tmp:/usr/sbin/nologin\n"
           "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
    _write(f"{root}/etc/group", "root:x:0:\nnogroup:x:65534:\n")
    _write(f"{root}/etc/hostname", "sandbox\n")
    _libc("sethostname", b"sandbox", ctypes.c_size_t(7))  # its own UTS namespace, not the host's
    os.mkdir(f"{root}/proc")
    os.mkdir(f"{root}/sandbox")
    _write(f"{root}{_RUNNER}", runner)
    _write(f"{root}/tmp/main.py", code)

    _blank_command_line()  # C's, so PID 1's
    init = _child(_reap_forever)  # the first child of an unshare(CLONE_NEWPID) process is PID 1
    code_pid = _child(_code_process, spec)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # so the trainer sees EOF as soon as the code's side is gone
    os.dup2(null, 2)
    _, status = os.waitpid(code_pid, 0)
    os.kill(init, signal.SIGKILL)
    os.waitpid(init, 0)
    _exit_like(status)


def _mount_proc(target):
    """A /proc of the PID namespace with its processes only (subset=pid, Linux 5.8+: no /proc/sys,
    so no boot id, no kernel command line, disks or swaps), or an empty one where the kernel refuses
    (e.g. in Docker, where parts of the host's /proc are masked)."""
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    try:
        _mount("proc", target, "proc", flags)
        try:
            # this namespace's limit: no nested user namespaces, a kernel exploit's usual first step
            _write(f"{target}/sys/user/max_user_namespaces", "0")
        finally:
            _libc("umount2", target.encode(), 0)
        _mount("proc", target, "proc", flags, "subset=pid")
    except OSError:
        _mount("tmpfs", target, "tmpfs", _MS_RDONLY | flags, "size=4k")


def _remount_all_readonly():
    """Remount every mount point of the sandbox's root read-only but the scratch tmpfs, /proc and
    the device files, keeping the other (possibly locked) flags."""
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        mount_point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        options = fields[5].split(",")
        if "ro" in options or mount_point in ("/tmp", "/proc") or mount_point.startswith("/dev/"):
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | sum(_MOUNT_OPTION_FLAGS.get(o, 0)
                                                          for o in options)
        if "noatime" not in options and "relatime" not in options:
            flags |= _MS_STRICTATIME
        try:
            _mount(None, mount_point, None, flags)
        except OSError as e:
            if e.errno != 13:  # EACCES: a mount point this identity cannot even reach
                raise


def _blank_command_line():
    """Overwrite this process's arguments with NULs: PID 1, forked from C, would show L's (the
    checkout's path, the spec) to the code in /proc/1/cmdline. (Cheaper than exec'ing a reaper
    inside the new root: a third interpreter start is +50% per run.)"""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # from field 3 on
    arg_start, arg_end = int(fields[45]), int(fields[46])  # fields 48 and 49
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(arg_start)
        mem.write(bytes(arg_end - arg_start))


def _reap_forever():
    """PID 1 of the sandbox: reap orphans until killed. No signal handlers: nothing inside can kill
    it."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # if C dies, so does PID 1, and with it the namespace
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    while True:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        signal.sigtimedwait([signal.SIGCHLD], 1.0)


def _code_process(spec):
    """PID 2, still our code: a /proc for this PID namespace, into the new root (the host's
    detached), all of it read-only but /tmp, no capabilities, the limits, then exec the runner."""
    _mount_proc(f"{_NEW_ROOT}/proc")  # while the host's /proc is in sight: the kernel requires one
    os.chdir(_NEW_ROOT)
    _libc("syscall", ctypes.c_long(_NR_PIVOT_ROOT[os.uname().machine]), b".", b".")
    _libc("umount2", b".", _MNT_DETACH)  # the host's root, stacked on ours by pivot_root(".", ".")
    os.chdir("/")
    _remount_all_readonly()
    os.chdir("/tmp")
    for cap in range(64):
        try:
            _prctl(_PR_CAPBSET_DROP, cap)
        except OSError as e:
            if e.errno != 22:  # EINVAL: past the kernel's last capability
                raise
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    _set_limits(spec, nproc=spec["max_processes"] + 2)  # + the namespace owner and PID 1, same user
    _exec_runner(spec, spec["view"]["python"], _RUNNER)


def _set_limits(spec, nproc):
    mb = 1 << 20
    limits = {resource.RLIMIT_AS: (spec["memory_mb"] * mb,) * 2,
              resource.RLIMIT_CPU: (spec["cpu_s"], spec["cpu_s"] + 1),
              resource.RLIMIT_FSIZE: (spec["max_file_mb"] * mb,) * 2,
              resource.RLIMIT_NPROC: (nproc, nproc),
              resource.RLIMIT_CORE: (0, 0)}
    for which, (soft, hard) in limits.items():
        current_hard = resource.getrlimit(which)[1]
        if current_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(which, (soft, hard))


def _exec_runner(spec, python, runner):
    """Close every other file descriptor, join a session keyring of the run's own, install the
    seccomp filter, exec the runner."""
    os.closerange(3, 1 << 16)
    machine = os.uname().machine
    if machine in _SECCOMP_SYSCALLS:  # so no keyring of the trainer's is even possessed; where
        # keyctl is refused already (Docker's default profile), nothing is lost
        ctypes.CDLL(None).syscall(ctypes.c_long(_SECCOMP_SYSCALLS[machine][1]["keyctl"]),
                                  ctypes.c_long(_KEYCTL_JOIN_SESSION_KEYRING), None)
    _install_filter(machine, spec["network"])
    os.execve(python, [python, "-I", "-B", runner, "--run"], dict(os.environ))


def _seccomp_filter(machine, network):
    """The seccomp BPF program of a run on this machine (os.uname().machine), or None if there is
    none; what it refuses: docs/sandbox.md, "The seccomp filter". clone3() gets ENOSYS as its flags
    are out of the filter's reach (the C library then falls back on clone())."""
    # a 32-bit interpreter would make foreign calls
    if machine not in _SECCOMP_SYSCALLS or sys.maxsize < 2**32:
        return None
    arch, nr, denied = _SECCOMP_SYSCALLS[machine]
    # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE|K, JSET|K, BPF_ALU|AND|K, RET|K
    load, jeq, jge, jset, and_, ret = 0x20, 0x15, 0x35, 0x45, 0x54, 0x06
    # seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 i (the low 32 bits first: these machines
    # are little-endian, and the kernel reads these int arguments from the low 32 bits only).
    program = [(load, None, None, 4),
               (jeq, 0, "deny", arch),
               (load, None, None, 0),
               *([(jge, "deny", 0, _X32_SYSCALL_BIT)] if machine == "x86_64" else []),
               *[(jeq, "deny", 0, number) for number in denied],
               (jeq, "enosys", 0, nr["clone3"]),
               *([] if network else [(jeq, "deny", 0, nr["socket"]),
                                     (jeq, "pair", 0, nr["socketpair"])]),
               (jeq, 0, "allow", nr["clone"]),
               (load, None, None, 16),  # clone's flags
               (jset, "deny", "allow", _CLONE_NAMESPACES),
               "pair",
               (load, None, None, 16),  # socketpair's domain
               (jeq, 0, "deny", _AF_UNIX),
               (load, None, None, 24),  # its type, without the SOCK_NONBLOCK and SOCK_CLOEXEC flags
               (and_, None, None, ~(_SOCK_NONBLOCK | _SOCK_CLOEXEC) & 0xFFFFFFFF),
               (jeq, "allow", "deny", _SOCK_STREAM),
               "allow", (ret, None, None, _SECCOMP_RET_ALLOW),
               "deny", (ret, None, None, _SECCOMP_RET_ERRNO | _EPERM),
               "enosys", (ret, None, None, _SECCOMP_RET_ERRNO | _ENOSYS)]
    labels, instructions = {}, []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(instructions)
        else:
            instructions.append(item)

    def jump(i, t):
        return 0 if t is None else t if isinstance(t, int) else labels[t] - i - 1
    return b"".join(struct.pack("=HBBI", code, jump(i, jt), jump(i, jf), k)
                    for i, (code, jt, jf, k) in enumerate(instructions))


def _install_filter(machine, network):
    """Install _seccomp_filter for this process and all it execs and starts (needs no_new_privs,
    set before). Without a filter for this machine, network=False cannot be enforced: an error;
    network=True runs without one (docs/sandbox.md)."""
    program = _seccomp_filter(machine, network)
    if program is None:
        if network:
            return
        raise RuntimeError(
            f"no seccomp filter for this machine ({machine}, {8 * struct.calcsize('P')}-bit "
            "interpreter), so network=False cannot be enforced (see sandbox.py)")

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    instructions = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(instructions))
    _libc("prctl", _PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER), ctypes.byref(fprog),
          ctypes.c_ulong(0), ctypes.c_ulong(0))


def _run_user_code():
    """The runner, in the sandboxed interpreter: compile main.py, run it as __main__, report how it
    ended."""
    sys.stdout.reconfigure(line_buffering=True)  # prints reach the trainer even if killed later
    with open("main.py", "rb") as f:
        source = f.read()
    try:
        code = compile(source, "main.py", "exec")
    except Exception as e:  # SyntaxError, ValueError (null bytes), RecursionError/MemoryError
        traceback.print_exception(type(e), e, None)
        sys.stderr.flush()
        os._exit(_EXIT_SYNTAX)
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"] = main  # so pickle / multiprocessing find the code's functions
    sys.argv = ["main.py"]
    try:
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: B036 - report every uncaught exception, as Python does
        sys.stdout.flush()
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # not the runner's frame
        sys.exit(_EXIT_MEMORY if isinstance(e, MemoryError) else _EXIT_EXCEPTION)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--launch"]:
        _launch(json.loads(sys.argv[2]))
    elif sys.argv[1:2] == ["--run"]:
        _run_user_code()
    else:  # python sandbox.py [FILE | -]: run it as the model's code would be, print the tool turn
        source = sys.stdin.read() if sys.argv[1:] in ([], ["-"]) else open(sys.argv[1]).read()
        try:
            print(f"[sandbox: {isolation()} isolation]", file=sys.stderr)
        except Unavailable as error:
            sys.exit(str(error))
        text = format_result(run_code(source))
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
