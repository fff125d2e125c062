"""Ways for sandboxed code to outlive its run, each tried repeatedly (the escapes they guard against
were intermittent) in every isolation mode this machine offers: when run_code returns, no process
the run started is alive, and the run's user (in "process" mode under root) has no process left.
Each hostile program ends by itself within seconds, so that a broken sandbox fails its test rather
than leaving the machine busy."""

import os
import tempfile
import textwrap
import time

import pytest

import sandbox
from config import SandboxConfig
from sandbox_machine import skip_without_namespaces, usable_python

REPEATS = 4
FAST = dict(timeout_s=3.0, cpu_s=4, memory_mb=512, max_processes=16, max_file_mb=8,
            max_output_bytes=4096)


@pytest.fixture(scope="module")
def tmp_root():
    root = tempfile.mkdtemp(prefix="sandbox-escape-root-")
    os.chmod(root, 0o711)  # under root, "process" mode's user must traverse it
    yield root
    os.rmdir(root)



@pytest.fixture(params=["namespaces", "process", "process without cgroup"])
def config(request, tmp_root, monkeypatch):
    """Each mode, and "process" without the per-run cgroup (as where /sys/fs/cgroup is read-only:
    the run's own user is what is killed)."""
    mode = request.param.split()[0]
    if mode == "namespaces":
        skip_without_namespaces()
    if request.param.endswith("without cgroup"):
        if os.geteuid() != 0:
            pytest.skip("no cgroup is used under a non-root trainer")
        monkeypatch.setattr(sandbox, "_new_cgroup", lambda: None)
    elif mode == "process" and os.geteuid() == 0 and sandbox._cgroup_parent() is None:
        pytest.skip("this machine allows no cgroup per run")
    python = usable_python(mode, tmp_root)
    if python is None:
        pytest.skip(f"no interpreter on this machine that {mode!r} mode's user can reach")
    return SandboxConfig(isolation=mode, python=python, tmp_root=tmp_root, **FAST)


def alive_with_marker(marker):
    """Pids of live (not zombie) processes whose command line or environment holds marker."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except (OSError, IndexError):
            continue
    return found


def run_escape(code, config):
    """Run code, whose escaping processes exec a command line carrying a marker of this run (so
    that they are told apart from other tests' runs); returns (the result, the survivors found the
    moment run_code returned, then one second later)."""
    marker = f"stare-escape-{os.getpid()}-{time.time_ns()}"
    body = textwrap.dedent(code).replace("MARKER", marker)
    result = sandbox.run_code(body, config)
    right_after = alive_with_marker(marker)
    time.sleep(0.2)
    later = alive_with_marker(marker)
    return result, right_after, later


# The survivor execs `python -c "..." MARKER`: it keeps running, visibly, until its own end.
SURVIVE = """
def survive(seconds):
    import os, sys
    os.execv(sys.executable, [sys.executable, '-c',
             f'import time; time.sleep({seconds})', 'MARKER'])
"""

SETSID_PTRACE_ZOMBIE = SURVIVE + """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()
if os.fork() == 0:                    # A: a session of its own
    os.setsid()
    if os.fork() == 0:                # B: traces A, so that A's zombie is B's to reap
        a = os.getppid()
        if libc.ptrace(16, a, None, None) == 0:          # PTRACE_ATTACH
            os.waitpid(a, 0)
            libc.ptrace(7, a, None, None)                # PTRACE_CONT
        os.write(w, b'x')
        survive(12)
    survive(12)
os.read(r, 1)
print('parent done')
"""

FORK_CHAIN = SURVIVE + """
import os, time
if os.fork() == 0:
    os.setsid()
    end = time.monotonic() + 4
    while time.monotonic() < end:     # a new process every moment, each parent gone at once
        try:
            if os.fork():
                os._exit(0)
        except BlockingIOError:       # RLIMIT_NPROC: the exited ones are not yet reaped
            time.sleep(0.001)
    survive(8)
time.sleep(0.3)
print('parent done')
"""

SETSID_DAEMON = SURVIVE + """
import os, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, b'x')
        survive(12)
    os._exit(0)
os.read(r, 1)
print('parent done')
"""


@pytest.mark.parametrize("code", [SETSID_PTRACE_ZOMBIE, FORK_CHAIN, SETSID_DAEMON],
                         ids=["setsid and a ptrace-attached zombie", "fork chain", "setsid"])
def test_nothing_outlives_its_run(config, code):
    bound = config.timeout_s + sandbox._STOP_GRACE_S + sandbox._KILL_S
    for attempt in range(REPEATS):
        start = time.monotonic()
        result, right_after, later = run_escape(code, config)
        took = time.monotonic() - start
        assert (right_after, later) == ([], []), (config.isolation, attempt, result)
        assert "parent done\n" in result.output, (config.isolation, attempt, result)
        assert took < bound + 1.0, (config.isolation, attempt, took)
    assert os.listdir(config.tmp_root) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the code runs as the trainer's own user")
@pytest.mark.parametrize("config", ["process", "process without cgroup"], indirect=True)
def test_a_run_never_gets_the_user_of_a_live_process(config):
    """A process left under the uid a run is about to get (an earlier holder's survivor, planted
    here) is gone before the run's code starts ("process" mode: "namespaces" mode runs every run
    as `nobody` in a PID namespace of its own). The launcher's pid fixes the run's user, so the
    next pid is set (ns_last_pid) to the one whose user holds the survivor; other processes of the
    machine may take it first, hence a few tries."""
    import subprocess
    if sandbox._run_user(os.getpid()) == sandbox._NOBODY:
        pytest.skip("this machine's user namespace maps no uid of its own per run")
    for _ in range(10):
        with open("/proc/sys/kernel/ns_last_pid") as f, open("/proc/sys/kernel/pid_max") as g:
            last, pid_max = int(f.read()), int(g.read())
        pid = 301 + (last + 1000 - 301) % (pid_max - 301)  # the kernel wraps to 300 past pid_max
        uid = sandbox._RUN_IDS + pid
        survivor = subprocess.Popen(["sleep", "30"], user=uid, group=uid, extra_groups=[])
        try:
            try:
                with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                    f.write(str(pid - 1))
            except OSError as error:
                pytest.skip(f"the next pid cannot be set here: {error}")
            result = sandbox.run_code("import os; print(os.getuid())", config)
            assert result.ok, result
            if int(result.output) == uid:
                assert survivor.poll() is not None, "the run shares its user with a live process"
                return
        finally:
            survivor.kill()
            survivor.wait()
    pytest.skip("another process took the planted pid every time")
