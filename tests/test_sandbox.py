"""Adversarial tests of sandbox.py. Every test runs in each isolation mode this machine offers
("namespaces" where user namespaces work, "process" always) and checks what that mode guarantees
(sandbox.py's docstring says which). Each hostile program is bounded, so that a broken sandbox fails
its test rather than harming the machine."""

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc

import pytest

import sandbox
from config import SandboxConfig
from sandbox_machine import skip_without_namespaces, usable_python

LANDLOCK = sandbox._landlock_abi() > 0  # "process" mode confines files only where Landlock exists
# timeout_s: the wall-clock ceiling of code that is not about it (a loaded machine can take seconds
# to start an interpreter in a new namespace); the tests of the wall-clock kill set KILL_AFTER_S
FAST = dict(
    timeout_s=15.0, cpu_s=2, memory_mb=512, max_processes=8, max_file_mb=8, max_output_bytes=4096)
KILL_AFTER_S = 2.0
# the kill's own bound: the grace after SIGTERM, then SIGKILL and the reaping
KILLED_WITHIN_S = KILL_AFTER_S + sandbox._STOP_GRACE_S + sandbox._KILL_S


@pytest.fixture(scope="module")
def tmp_root():
    # Not pytest's tmp_path: under root, "process" mode needs a directory `nobody` can traverse.
    root = tempfile.mkdtemp(prefix="sandbox-test-root-")
    os.chmod(root, 0o711)
    yield root
    os.rmdir(root)  # fails the teardown if a run left anything behind


@pytest.fixture(scope="module", params=["namespaces", "process"])
def mode_config(request, tmp_root):
    mode = request.param
    if mode == "namespaces":
        skip_without_namespaces()
    python = usable_python(mode, tmp_root)
    if python is None:
        pytest.skip(f"no interpreter on this machine that {mode!r} mode's user can reach")
    return mode, SandboxConfig(isolation=mode, python=python, tmp_root=tmp_root, **FAST)


def run(code, config, **overrides):
    result = sandbox.run_code(textwrap.dedent(code), dataclasses.replace(config, **overrides))
    assert os.listdir(config.tmp_root) == [], "a private directory was left behind"
    return result


def batch(codes, config, **overrides):
    return sandbox.run_batch(
        [textwrap.dedent(c) for c in codes], dataclasses.replace(config, **overrides))


def read_proc(pid, name):
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile
        return b""


def ancestors(pid):
    """pid, its parent, its parent's parent, ... up to pid 1."""
    chain = []
    while pid > 0 and pid not in chain:
        chain.append(pid)
        status = read_proc(pid, "status").decode()
        pid = int(next((line.split()[1] for line in status.splitlines()
                        if line.startswith("PPid:")), 0))
    return chain


def started_by_another_test(pid):
    """Whether a sandboxed process belongs to a test running beside this one (another
    pytest-xdist worker's). Its first ancestor that is not a sandbox process is that test's process
    or a trainer it started. A runner that outlived its trainer was reparented to pid 1 or to one of
    this process's own ancestors: it counts as this test's, the failure the callers look for."""
    chain = ancestors(pid)
    if os.getpid() in chain:
        return False
    sandboxed = [path.encode() for path in (sandbox._THIS_FILE, sandbox._RUNNER)]
    owner = next((p for p in chain if not any(m in read_proc(p, "cmdline") for m in sandboxed)), 1)
    return owner != 1 and owner not in ancestors(os.getpid())


def is_runner(pid):
    """Whether pid is a sandboxed interpreter still alive (its command line: the runner, --run)."""
    markers = [path.encode() + b"\0--run" for path in (sandbox._THIS_FILE, sandbox._RUNNER)]
    return any(marker in read_proc(pid, "cmdline") for marker in markers)


def runner_processes():
    """Pids of sandboxed interpreters still alive, but for those another test started."""
    return [int(pid) for pid in filter(str.isdigit, os.listdir("/proc"))
            if is_runner(pid) and not started_by_another_test(int(pid))]


# ---------------------------------------------------------------------------------------------------- normal use


def test_output_stdout_and_stderr_interleaved(mode_config):
    _, config = mode_config
    result = run("""
        import sys
        print('one')
        print('two', file=sys.stderr)
        print('three')
    """, config)
    assert (result.ok, result.error, result.exit_code, result.truncated) == (True, "", 0, False)
    assert result.output == "one\ntwo\nthree\n"
    assert sandbox.format_result(result) == "one\ntwo\nthree\n"
    assert sandbox.format_result(run("x = 1", config)) == "(no output)"


def test_private_working_directory(mode_config):
    mode, config = mode_config
    result = run(
        "import os; print(os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'], os.listdir('.'))",
        config)
    cwd, home, tmpdir, listing = result.output.split(" ", 3)
    assert cwd == home == tmpdir
    if mode == "namespaces":
        assert cwd == "/tmp"  # its own tmpfs; only the interpreter's files in the host's /tmp show
        binds = sandbox._view(config.python, config.network)["binds"]
        needed = {target.split("/")[2] for _, target in binds if target.startswith("/tmp/")}
        assert sorted(eval(listing)) == sorted({"main.py", *needed})
    else:
        assert listing == "['main.py']\n"
        # in a directory of the trainer's, both removed after the run
        assert os.path.dirname(os.path.dirname(cwd)) == config.tmp_root
        assert not os.path.exists(os.path.dirname(cwd))


def test_environment_is_not_inherited(mode_config, monkeypatch):
    _, config = mode_config
    monkeypatch.setenv("STARE_TEST_SECRET", "hunter2")
    result = run(
        "import os; print(os.environ.get('STARE_TEST_SECRET'), os.environ['OMP_NUM_THREADS'])",
        config)
    assert result.output == "None 1\n"


def test_stdin_is_closed(mode_config):
    _, config = mode_config
    result = run("input()", config)
    assert result.error == "exception" and "EOFError" in result.output


def test_batch_runs_in_parallel_and_keeps_order(mode_config):
    _, config = mode_config
    # the first ends last; each says when it slept (the wall clock is the host's in every mode),
    # so parallel means overlapping sleeps, whatever a loaded machine adds to start-up
    codes = [f"import time; t = time.time(); time.sleep({1.5 - 0.1 * i:.1f}); "
             f"print({i}, t, time.time())" for i in range(6)]
    results = batch(codes, config, max_workers=6)
    lines = [r.output.split() for r in results]
    assert [int(line[0]) for line in lines] == list(range(6))
    sleeps = [(float(line[1]), float(line[2])) for line in lines]
    most_at_once = max(sum(begin <= t < end for begin, end in sleeps) for t, _ in sleeps)
    assert most_at_once >= 2, f"the batch ran one at a time: {sleeps}"
    assert sandbox.run_batch([], config) == []


# --------------------------------------------------------------------------------------------- errors of the code

SYNTAX_ERROR = """
    print('never')
    def f(:
        pass
"""


def test_syntax_error(mode_config):
    _, config = mode_config
    result = run(SYNTAX_ERROR, config)
    assert (result.ok, result.error) == (False, "syntax")
    assert 'File "main.py", line 3' in result.output and "SyntaxError" in result.output
    assert "never" not in result.output
    text = sandbox.format_result(result)
    assert text.endswith("\nError: the code has a syntax error")
    assert text == sandbox.format_result(run(SYNTAX_ERROR, config))  # deterministic


def test_missing_module(mode_config):
    _, config = mode_config
    result = run("print('before')\nimport no_such_module_xyz", config)
    assert result.error == "exception"
    assert result.output.startswith(
        'before\nTraceback (most recent call last):\n  File "main.py", line 2')
    assert "ModuleNotFoundError: No module named 'no_such_module_xyz'" in result.output
    assert "sandbox.py" not in result.output  # the runner's own frame is not shown


def test_exit_code(mode_config):
    _, config = mode_config
    result = run("import os\nprint('bye', flush=True)\nos._exit(3)", config)
    assert (result.ok, result.error, result.exit_code) == (False, "exit_code", 3)
    assert sandbox.format_result(result) == "bye\nError: the code exited with status 3"
    assert run("import sys; sys.exit(0)", config).ok


# ------------------------------------------------------------------------------------------------------- limits


def test_infinite_loop_times_out(mode_config):
    _, config = mode_config
    start = time.monotonic()
    result = run("print('started')\nwhile True:\n    pass", config, cpu_s=30,
                 timeout_s=KILL_AFTER_S)
    assert time.monotonic() - start < KILLED_WITHIN_S
    assert (result.error, result.exit_code, result.output) == ("timeout", None, "started\n")
    assert sandbox.format_result(result).endswith(
        "Error: timed out after 2 s (the code was killed)")


def test_cpu_limit(mode_config):
    _, config = mode_config
    start = time.monotonic()
    result = run("while True:\n    pass", config, cpu_s=1, timeout_s=30)
    assert result.error == "cpu" and result.exit_code == -signal.SIGXCPU
    assert time.monotonic() - start < 15  # the CPU limit ended it, not the wall clock


def test_allocating_10_gib(mode_config):
    _, config = mode_config
    start = time.monotonic()
    result = run("x = bytearray(10 * 1024**3)\nprint('allocated')", config)
    assert (
        result.error == "memory"
        and "MemoryError" in result.output
        and "allocated" not in result.output)
    assert time.monotonic() - start < config.timeout_s / 2  # refused, not swapped until the kill


def test_fork_limit(mode_config):
    _, config = mode_config
    result = run("""
        import os, time
        n = 0
        try:
            for _ in range(200):  # bounded: without a limit the assertion fails, not the machine
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            print('refused', e.errno)
        print('forks', n)
    """, config)
    assert "refused 11" in result.output  # EAGAIN
    forks = int(result.output.split("forks ")[1])
    # "process" mode counts the user's tasks (racy)
    assert forks < config.max_processes + 3, result.output
    # the children sleep 30 s
    assert result.ok and result.duration_s < 10, "the sleeping children must die with the code"
    assert runner_processes() == []


def test_fork_bomb(mode_config):
    _, config = mode_config
    result = run("""
        import os, time
        for _ in range(10):  # 2**10 processes without a limit
            try:
                os.fork()
            except OSError:
                pass
        time.sleep(60)  # so only the wall-clock kill ends it
    """, config, timeout_s=KILL_AFTER_S)
    assert result.error == "timeout"
    assert runner_processes() == []


def test_huge_file(mode_config):
    _, config = mode_config
    start = time.monotonic()
    result = run("""
        with open('big', 'wb') as f:
            for _ in range(1024):
                f.write(b'x' * 2**20)
        print('wrote 1 GiB')
    """, config)
    assert result.error == "exception" and "wrote" not in result.output
    assert "File too large" in result.output or "No space left on device" in result.output
    assert time.monotonic() - start < config.timeout_s / 2  # refused, not written until the kill


def test_print_100_mb(mode_config):
    _, config = mode_config
    tracemalloc.start()
    try:
        result = run(
            "import sys\nsys.stdout.write('x' * 100_000_000)\nprint('END')", config, timeout_s=20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.ok and result.truncated and result.output_bytes == 100_000_004
    assert result.output.startswith("x" * 100) and result.output.endswith("xxEND\n")
    assert (
        "bytes of output omitted" in result.output
        and len(result.output) < config.max_output_bytes + 100)
    assert peak < 2 * 2**20, f"the trainer held {peak} bytes"
    assert result.duration_s < 10


def test_many_prints_keep_head_and_tail(mode_config):
    _, config = mode_config
    result = run("for i in range(100000):\n    print(i)", config, timeout_s=10)
    assert result.ok and result.truncated
    assert result.output.startswith("0\n1\n2\n") and result.output.endswith("99998\n99999\n")


# --------------------------------------------------------------------------------------------------- isolation


def test_network_is_unreachable(mode_config):
    mode, config = mode_config
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"""
            import socket
            socket.create_connection(('127.0.0.1', {port}), timeout=1)
            print('connected')
        """
        result = run(code, config)
        assert result.error == "exception" and "connected" not in result.output
        # socket() itself: the filter
        assert "PermissionError: [Errno 1] Operation not permitted" in result.output
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached the listening socket
        assert run(code, config, network=True).output == "connected\n"  # and the switch works


@pytest.fixture(params=["/var/tmp", "project", "abstract"])
def host_unix_server(request):
    """S05: a host server on a Unix socket the sandbox might reach: on disk under /var/tmp, on disk
    in a directory of the project (outside every place the sandbox hides), or abstract. Anyone may
    connect (socket 0777, directory 0711), so only the sandbox can stop it. Yields (address,
    server); the server is non-blocking and never accepts by itself, so a test sees exactly the
    connections that reached it."""
    if request.param == "abstract":
        directory, address = None, f"\0stare-sandbox-test-{os.getpid()}-{time.time_ns()}"
    else:
        where = (
            os.path.dirname(os.path.abspath(__file__))
            if request.param == "project"
            else request.param)
        directory = tempfile.mkdtemp(prefix="sandbox-s05-", dir=where)
        os.chmod(directory, 0o711)
        address = os.path.join(directory, "s.sock")
        if len(address.encode()) > 100:
            os.rmdir(directory)
            pytest.skip(f"{address} is too long for a Unix socket address")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(address)
        if directory:
            os.chmod(address, 0o777)
        server.listen(8)
        server.setblocking(False)
        yield address, server
    finally:
        server.close()
        if directory:
            shutil.rmtree(directory)


def _accepted(server):
    """What reached the server: the first bytes of each pending connection."""
    received = []
    while True:
        try:
            connection, _ = server.accept()
        except BlockingIOError:
            return received
        with connection:
            connection.settimeout(2)
            received.append(connection.recv(100))


def test_host_unix_sockets_are_unreachable(mode_config, host_unix_server):
    _, config = mode_config
    address, server = host_unix_server
    code = f"""
        import socket
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(1)
        s.connect({address!r})
        s.sendall(b'hello from the sandbox')
        print('connected')
    """
    result = run(code, config)
    assert result.error == "exception" and "connected" not in result.output
    assert "PermissionError: [Errno 1] Operation not permitted" in result.output  # socket() itself
    assert _accepted(server) == []
    # network=True shares the host's sockets, as documented, wherever the sandbox can see the
    # socket's file (in "namespaces" mode no file of the host but the interpreter's: abstract only)
    shared = run(code, config, network=True).output
    if _out_of_sight(mode_config[0], address):
        assert "FileNotFoundError" in shared and _accepted(server) == []
    else:
        assert shared == "connected\n" and _accepted(server) == [b"hello from the sandbox"]


def _out_of_sight(mode, address):
    return mode == "namespaces" and not address.startswith("\0")


def test_no_way_around_the_socket_filter(mode_config, host_unix_server):
    _, config = mode_config
    address, server = host_unix_server
    code = f"""
        import ctypes, os, socket
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        def attempt(name, f):
            try:
                print(name, 'worked', f())
            except OSError as e:
                print(name, 'refused', e.errno)
        def raw(nr, *args):
            if libc.syscall(ctypes.c_long(nr), *args) < 0:
                raise OSError(ctypes.get_errno(), 'raw syscall')
        numbers = {{'x86_64': (41, 53), 'aarch64': (198, 199), 'riscv64': (198, 199)}}[os.uname().machine]
        attempt('raw socket', lambda: raw(numbers[0], 1, 1, 0))  # socket(AF_UNIX, SOCK_STREAM, 0) without Python
        if os.uname().machine == 'x86_64':
            attempt('x32 socket', lambda: raw(0x40000000 | 41, 1, 1, 0))
        attempt('dgram pair', lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM))
        attempt('seqpacket pair', lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET))
        pair = (ctypes.c_int * 2)()
        attempt('raw dgram pair', lambda: raw(numbers[1], 1, 2 | 0x80000, 0, pair))  # SOCK_DGRAM | SOCK_CLOEXEC
        a, b = socket.socketpair()  # allowed, and already connected to its twin
        attempt('pair connect', lambda: a.connect({address!r}))
        attempt('pair sendto', lambda: a.sendto(b'x', {address!r}))
        params = ctypes.create_string_buffer(120)  # struct io_uring_params
        attempt('io_uring', lambda: raw(425, 4, params))
    """
    result = run(code, config)
    attempts = [
        "raw socket", "x32 socket", "dgram pair", "seqpacket pair", "raw dgram pair",
        "pair connect", "pair sendto", "io_uring"]
    if os.uname().machine != "x86_64":
        attempts.remove("x32 socket")
    lines = result.output.splitlines()
    assert [line.rsplit(" refused ", 1)[0] for line in lines] == attempts, result.output
    # EPERM from the filter; the pair's connect and sendto fail on their own (EISCONN, or
    for line in lines:
        name, errno = line.rsplit(" refused ", 1)  # ECONNREFUSED where the lookup fails first)
        # ENOENT where the socket's file is out of sight (every one in "namespaces" mode)
        assert int(errno) in ((106, 111, 2) if name.startswith("pair ") else (1,)), line
    assert _accepted(server) == []


def test_socket_pairs_still_work(mode_config):
    """What Python itself needs sockets for inside the sandbox: asyncio's event loop, multiprocessing's pipes."""
    _, config = mode_config
    result = run("""
        import asyncio, multiprocessing, socket
        async def main():
            await asyncio.sleep(0)
            return 'asyncio ok'
        print(asyncio.run(main()))
        a, b = socket.socketpair()
        a.sendall(b'pair ok')
        print(b.recv(100).decode())
        def square(x):
            return x * x
        if __name__ == '__main__':
            with multiprocessing.get_context('fork').Pool(2) as pool:
                print(pool.map(square, range(4)))
            parent, child = multiprocessing.Pipe()
            child.send('pipe ok')
            print(parent.recv())
            import subprocess, sys  # threads and posix_spawn: clone3 refused, clone works
            print(subprocess.run([sys.executable, '-c', 'print(2)'], capture_output=True,
                                 text=True).stdout, end='')
    """, config)
    assert result.output == "asyncio ok\npair ok\n[0, 1, 4, 9]\npipe ok\n2\n", result.output


def test_abstract_sockets_are_per_network_namespace():
    """The second wall of "namespaces" mode: an abstract Unix socket (no file) lives in a network
    namespace, so a process in a new one cannot reach the host's. Checked on the kernel directly,
    since in the sandbox the filter stops the code before it could try."""
    name = f"\0stare-netns-test-{os.getpid()}-{time.time_ns()}"
    probe = f"""
        import ctypes, errno, os, socket
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x10000000 | 0x40000000):  # CLONE_NEWUSER | CLONE_NEWNET
            print('no namespaces:', os.strerror(ctypes.get_errno()))
            raise SystemExit
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(1)
            try:
                s.connect({name!r})
                print('connected')
            except OSError as e:
                print(errno.errorcode[e.errno])
    """
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(name)
        server.listen(1)
        server.setblocking(False)
        output = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(probe)], capture_output=True, text=True,
            timeout=20).stdout
        if output.startswith("no namespaces"):
            pytest.skip(output.strip())
        assert output == "ECONNREFUSED\n"
        with pytest.raises(BlockingIOError):
            server.accept()
        # the same connect from the host's namespace arrives
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(name)
            server.accept()[0].close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_signalling_the_parent(mode_config, sig):
    mode, config = mode_config
    result = run(f"""
        import os
        print(os.getppid(), flush=True)
        os.kill(os.getppid(), {int(sig)})
        print('after')
    """, config)
    # Whatever it hit was inside the sandbox: this test process is still here.
    if mode == "namespaces":
        # no parent in its PID namespace; kill(0) hits its own group
        assert result.output.startswith("0\n")
        assert (result.error, result.exit_code) == ("killed", -sig)
    else:
        assert int(result.output.split()[0]) != os.getpid()  # its parent is the launcher, not us
        assert not result.ok


def test_signalling_the_trainer_by_pid(mode_config):
    mode, config = mode_config
    if mode == "process" and os.geteuid() != 0:
        pytest.skip("documented: in 'process' mode a non-root trainer shares its uid with the code")
    result = run(f"import os\nos.kill({os.getpid()}, 9)", config)
    assert result.error == "exception"
    assert ("ProcessLookupError" if mode == "namespaces" else "PermissionError") in result.output


def test_kill_everything_stays_in_its_namespace(mode_config):
    mode, config = mode_config
    if mode == "process" and os.geteuid() != 0:
        pytest.skip("documented: in 'process' mode a non-root trainer shares its uid with the code")
    results = batch(
        [
            "import time\ntime.sleep(1.0)\nprint('survived')",
            "import os, time\ntime.sleep(0.3)\nos.kill(-1, 9)"],
        config,
        max_workers=2,
        timeout_s=10)
    assert results[0].ok and results[0].output == "survived\n"
    if mode == "namespaces":
        assert "ProcessLookupError" in results[1].output  # there was nobody else to kill


def test_writing_outside(mode_config):
    mode, config = mode_config
    if mode == "process" and not LANDLOCK:
        pytest.skip("documented: 'process' mode without Landlock leaves world-writable places")
    private = ["/tmp", "/dev/shm"] if mode == "namespaces" else ["."]  # its tmpfs (also /dev/shm)
    targets = [
        tempfile.mkdtemp(), tempfile.mkdtemp(dir="/var/tmp"),
        os.path.dirname(os.path.abspath(__file__))]
    for target in targets[:2]:
        os.chmod(target, 0o777)  # writable by anyone: only the sandbox can stop it
    name = f"sandbox-escape-{os.getpid()}"
    try:
        result = run(f"""
            import os
            for d in {targets!r}:
                try:
                    open(os.path.join(d, {name!r}), 'w').write('x')
                    print('wrote', d)
                except OSError as e:
                    print('refused', e.errno)
            for d in {private!r}:
                open(os.path.join(d, {name!r}), 'w').write('x')
            print('private ok')
        """, config)
        assert "wrote" not in result.output and result.output.count("refused") == 3
        assert result.output.endswith("private ok\n")
        for path in [os.path.join(t, name) for t in targets] + [f"/tmp/{name}", f"/dev/shm/{name}"]:
            assert not os.path.exists(path), path
    finally:
        for target in targets[:2]:
            for leftover in os.listdir(target):
                os.remove(os.path.join(target, leftover))
            os.rmdir(target)


def test_concurrent_runs_cannot_see_each_other(mode_config):
    mode, config = mode_config
    if mode == "process" and os.geteuid() != 0:
        pytest.skip("documented: in 'process' mode a non-root trainer shares its uid with the code")
    token = f"secret-{os.getpid()}-{time.time_ns()}"
    writer = f"""
        import os, time
        for d in ('.', '/tmp', '/dev/shm'):
            try:  # "process" mode with Landlock: the host's /tmp is refused
                open(os.path.join(d, 'secret.txt'), 'w').write({token!r})
            except PermissionError:
                pass
        time.sleep(1.5)
        print('written')
    """
    reader = f"""
        import os, sys, time
        token = {token[::-1]!r}[::-1]  # not spelled out in its own main.py
        time.sleep(0.5)
        found = []
        # the interpreter's read-only folders are no run's: skip them (a checkout under /tmp puts
        # its .venv there, thousands of files)
        interpreter = (sys.prefix + '/', sys.base_prefix + '/')
        for top in ('.', '/tmp', '/dev/shm', {config.tmp_root!r}, '/proc'):
            for root, dirs, files in os.walk(top):
                dirs[:] = [d for d in dirs if not (os.path.abspath(os.path.join(root, d))
                                                   + '/').startswith(interpreter)]
                if root.startswith('/proc/') and root.count('/') > 2:
                    continue
                for f in files:
                    try:
                        if token in open(os.path.join(root, f), errors='ignore').read(100000):
                            found.append(os.path.join(root, f))
                    except OSError:
                        pass
        print('found', found)
    """
    results = batch([writer, reader], config, max_workers=2, timeout_s=10)
    assert results[0].output == "written\n"
    assert results[1].output == "found []\n", results[1].output


def test_setsid_does_not_escape(mode_config):
    _, config = mode_config
    result = run("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
        print('parent done')
    """, config)
    assert result.ok and result.output == "parent done\n"
    assert runner_processes() == []


def test_cannot_regain_privileges(mode_config):
    mode, config = mode_config
    if mode == "process" and os.geteuid() != 0:
        pytest.skip("the code runs as the trainer's own user here")
    result = run("""
        import os
        try:
            os.setuid(1 if os.getuid() == 0 else 0)
            print('setuid worked')
        except OSError:  # EPERM, or EINVAL where that uid is not mapped at all
            print('refused')
        import ctypes  # capget(2), as /proc may be out of reach
        header, data = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()
        if ctypes.CDLL(None).capget(header, data):
            raise SystemExit('capget failed')
        print(list(data))
    """, config)
    refused, capabilities = result.output.split(maxsplit=1)
    assert refused == "refused"
    assert eval(capabilities) == [0] * 6, "capabilities survived"


def test_no_files_left_behind(mode_config):
    _, config = mode_config
    before = set(os.listdir(tempfile.gettempdir()))
    result = run("""
        import os
        os.makedirs('a/b/c')
        open('a/b/c/f', 'w').write('x')
        os.chmod('a/b/c', 0)  # the clean-up must cope
        os.chmod('a', 0o500)
        open(os.environ['TMPDIR'] + '/t', 'w').write('x')
        while True:
            pass
    """, config, timeout_s=KILL_AFTER_S)  # run() checks that tmp_root is empty again
    assert result.error == "timeout"
    new = set(os.listdir(tempfile.gettempdir())) - before
    assert not new & {"t", "a"}  # what the code wrote did not reach the real /tmp
    # nor anything else, but for what tests running beside this one (pytest-xdist) make meanwhile
    assert {n for n in new if not n.startswith(("sandbox-test-", "stare-sandbox-", "tmp"))} == set()


# ------------------------------------------------------------------ nothing shared, nothing left

_PYTHONS = {}


@pytest.fixture(params=["namespaces", "process", "process without Landlock"])
def every_mode(request, monkeypatch, tmp_root):
    """Each mode, and "process" with its fallback forced (no Landlock, as on a kernel before 5.13:
    the trainer reads the ABI and hands it to the launcher)."""
    mode = request.param.split()[0]
    if mode == "namespaces":
        skip_without_namespaces()
    if request.param.endswith("without Landlock"):
        monkeypatch.setattr(sandbox, "_landlock_abi", lambda: 0)
    elif mode == "process" and not LANDLOCK:
        pytest.skip("this kernel has no Landlock")
    if mode not in _PYTHONS:
        _PYTHONS[mode] = usable_python(mode, tmp_root)
    if _PYTHONS[mode] is None:
        pytest.skip(f"no interpreter on this machine that {mode!r} mode's user can reach")
    return request.param, SandboxConfig(isolation=mode, python=_PYTHONS[mode], tmp_root=tmp_root,
                                        **FAST)


def test_nothing_outlives_the_run(every_mode):
    """A key, a nested namespace, a watch, System V memory, a file in /dev/shm: refused, or gone
    with the run."""
    variant, config = every_mode
    name = f"stare-sandbox-test-{os.getpid()}-{time.time_ns()}"
    with open("/proc/sysvipc/shm") as f:
        segments = f.read()
    code = f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        add_key, keyctl, clone = {{'x86_64': (248, 250, 56), 'aarch64': (217, 219, 220),
                                  'riscv64': (217, 219, 220)}}[os.uname().machine]
        def attempt(what, result):
            print(what, 'worked' if result >= 0 else f'refused {{ctypes.get_errno()}}')
        key = (b'user', {name.encode()!r}, b'payload', ctypes.c_size_t(7))
        attempt('user key', libc.syscall(add_key, *key, ctypes.c_long(-4)))
        attempt('session key', libc.syscall(add_key, *key, ctypes.c_long(-3)))
        attempt('persistent keyring',
                libc.syscall(keyctl, 22, ctypes.c_long(-1), ctypes.c_long(-4)))
        attempt('user namespace', libc.unshare(0x10000000))
        attempt('mount, net, pid namespaces', libc.unshare(0x20000 | 0x40000000 | 0x20000000))
        pid = libc.syscall(clone, 0x10000000 | 17, 0, 0, 0, 0)  # CLONE_NEWUSER | SIGCHLD
        if pid == 0:
            os._exit(0)
        attempt('clone into a namespace', pid)
        attempt('inotify', libc.inotify_init1(0))
        attempt('System V memory', libc.shmget(0, 4096, 0o1600))
        for path in ('/dev/shm/{name}', '/dev/shm/{name}.d/f'):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, 'w').write('x')
        print('written')
    """
    result = run(code, config)
    attempts = ["user key", "session key", "persistent keyring", "user namespace",
                "mount, net, pid namespaces", "clone into a namespace", "inotify",
                "System V memory"]
    assert result.output == "".join(f"{a} refused 1\n" for a in attempts) + "written\n", (
        variant, result.output)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(name)]
    with open("/proc/sysvipc/shm") as f:
        assert f.read() == segments
    with open("/proc/keys") as f:
        assert name not in f.read()
    if variant == "process without Landlock":  # the fallback was in force: /proc is open to it
        assert run("import os; print(bool(os.listdir('/proc')))", config).output == "True\n"


@pytest.mark.parametrize("landlock", [True, False], ids=["Landlock", "without Landlock"])
def test_the_clean_up_follows_no_symlink(landlock, monkeypatch):
    """In "process" mode the code replaces its directory, and entries inside it, with symlinks to
    a directory of the host's; the root trainer's clean-up must leave that directory as it was.
    tmp_root is sticky and world-writable, as /tmp is."""
    if landlock and not LANDLOCK:
        pytest.skip("this kernel has no Landlock")
    if not landlock:
        monkeypatch.setattr(sandbox, "_landlock_abi", lambda: 0)
    python = usable_python("process", "")
    if python is None:
        pytest.skip("no interpreter on this machine that 'process' mode's user can reach")
    sticky = tempfile.mkdtemp(prefix="sandbox-test-sticky-")
    os.chmod(sticky, 0o1777)
    victim = tempfile.mkdtemp(prefix="sandbox-test-victim-", dir="/var/tmp")
    os.chmod(victim, 0o755)
    with open(os.path.join(victim, "keep"), "w") as f:
        f.write("kept")
    config = SandboxConfig(isolation="process", python=python, tmp_root=sticky, **FAST)
    try:
        result = run(f"""
            import os
            here = os.getcwd()
            for attempt in (lambda: os.rename(here, here + '.moved'),
                            lambda: os.rename(os.path.dirname(here),
                                              os.path.dirname(here) + '.moved'),
                            lambda: os.symlink({victim!r}, os.path.dirname(here) + '/x')):
                try:
                    attempt()
                    print('worked')
                except OSError as e:
                    print('refused', e.errno)
            os.symlink({victim!r}, 'to_dir')
            os.symlink({victim + '/keep'!r}, 'to_file')
            os.mkdir('sub')
            os.symlink({victim!r}, 'sub/to_dir')
            os.chmod('sub', 0)
        """, config)
        lines = result.output.splitlines()  # EACCES, or EPERM (the sticky bit)
        assert result.ok and lines in (["refused 13"] * 3,
                                       ["refused 13", "refused 1", "refused 13"]), result.output
        assert oct(os.stat(victim).st_mode & 0o7777) == "0o755"
        assert oct(os.stat(victim + "/keep").st_mode & 0o7777) == "0o644"
        assert open(victim + "/keep").read() == "kept" and os.listdir(victim) == ["keep"]
    finally:
        shutil.rmtree(victim)
        os.rmdir(sticky)  # fails if the run left anything behind


def test_clear_removes_a_hostile_tree(tmp_path):
    """_clear on what code may leave: unreadable directories, symlinks out, a tree deeper than
    Python's recursion limit; what the symlinks name is untouched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("x")
    top = tmp_path / "top"
    (top / "a").mkdir(parents=True)
    fd = os.open(top / "a", os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1200):  # by relative names: the path is longer than PATH_MAX
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
        os.close(parent)
    os.symlink(outside, "to_outside", dir_fd=fd)
    os.close(fd)
    (top / "to_file").symlink_to(outside / "f")
    (top / "locked").mkdir()
    (top / "locked" / "f").write_text("x")
    os.chmod(top / "locked", 0)
    os.chmod(top / "a", 0o500)
    os.chmod(outside, 0o751)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        sandbox._clear(fd)
    finally:
        os.close(fd)
    assert os.listdir(top) == [] and os.listdir(outside) == ["f"]
    assert os.stat(outside).st_mode & 0o7777 == 0o751


def test_auto_retries_and_stops_in_one_line(monkeypatch):
    """Under "auto" one failed probe is retried; two stop with the probe's reason, unless the
    fallback to "process" is allowed."""
    said = []
    monkeypatch.setattr(sandbox, "_PROBE_RETRY_S", 0)
    monkeypatch.setattr(sandbox, "_out_of_reach", lambda python, view, tmp_root: None)

    def probe(outcomes):
        def _probe(config):
            said.append(outcomes[min(len(said), len(outcomes) - 1)])
            return said[-1]
        return _probe

    for outcomes, allow, expected in ((["busy", None], False, "namespaces"),
                                      (["busy", "no userns"], True, "process"),
                                      (["busy", "no userns"], False, "no userns")):
        monkeypatch.setattr(sandbox, "_MODES", {})
        monkeypatch.setattr(sandbox, "_probe", probe(outcomes))
        said.clear()
        config = SandboxConfig(allow_process_fallback=allow)
        if expected == "no userns":
            with pytest.raises(sandbox.Unavailable) as error:
                sandbox.isolation(config)
            message = str(error.value)
            assert "no userns" in message and "allow_process_fallback" in message
            assert "\n" not in message
            result = sandbox.run_code("print(1)", config)  # never raises: a "sandbox" result
            assert result.error == "sandbox" and "no userns" in result.message
        elif allow:
            with pytest.warns(UserWarning, match="no userns"):
                assert sandbox.isolation(config) == expected
        else:
            assert sandbox.isolation(config) == expected
        assert len(said) >= 2


@pytest.mark.skipif(os.geteuid() != 0, reason="the code runs as the trainer's own user")
def test_an_interpreter_out_of_reach_is_one_line():
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no /usr/bin/python3 here")
    """Under root, "process" mode runs the code as an unprivileged user: an interpreter that user
    cannot reach (a pyenv under /root) is found before any run, and the line says what to set."""
    hidden = tempfile.mkdtemp(prefix="sandbox-test-hidden-")  # 0700, root's
    try:
        os.symlink(os.path.realpath(sys.executable), f"{hidden}/python3")
        config = SandboxConfig(isolation="process", python=f"{hidden}/python3")
        with pytest.raises(sandbox.Unavailable, match=f"{hidden} is 700.*set sandbox.python"):
            sandbox.isolation(config)
        result = sandbox.run_code("print(1)", config)
        assert result.error == "sandbox" and "sandbox.python" in result.message
        config = SandboxConfig(isolation="process", python="/usr/bin/python3", tmp_root=hidden)
        with pytest.raises(sandbox.Unavailable, match=f"{hidden} is 700.*set sandbox.tmp_root"):
            sandbox.isolation(config)
    finally:
        shutil.rmtree(hidden)


# ------------------------------------------------------------------- what the code sees of the host

@pytest.fixture
def root_only_file():
    """A file only its owner may read (0600), in a directory anyone may traverse (0711), outside."""
    directory = tempfile.mkdtemp(prefix="sandbox-secret-", dir="/var/tmp")
    os.chmod(directory, 0o711)
    path = os.path.join(directory, "secret.txt")
    with open(path, "w") as f:
        f.write("hunter2")
    os.chmod(path, 0o600)
    yield path
    shutil.rmtree(directory)


def test_the_host_is_out_of_sight(mode_config, root_only_file):
    """Issue 22: code that looks for the host's files, network interfaces, mounts and boot id."""
    mode, config = mode_config
    checkout = os.path.dirname(sandbox._THIS_FILE)
    attempts = {
        "secret": f"read({root_only_file!r})",
        "secret via /proc/self/root": f"read('/proc/self/root' + {root_only_file!r})",
        "/root": "os.listdir('/root')",
        "/home": "os.listdir('/home')",
        "checkout": f"os.listdir({checkout!r})",
        "its .git": f"read({checkout + '/.git'!r})",  # a directory, or a worktree's file
        "/sys/class/net": "os.listdir('/sys/class/net')",
        "mountinfo": "read('/proc/self/mountinfo')",
        "boot id": "read('/proc/sys/kernel/random/boot_id')",
        "other runs": f"os.listdir({config.tmp_root!r})",  # where "process" mode makes directories
        "PID 1": "sorted(set(read('/proc/1/cmdline')))",  # "namespaces": the reaper, a copy of L
    }
    code = "import os\ndef read(path):\n    with open(path) as f:\n        return f.read()\n"
    for name, expression in attempts.items():
        code += f"try:\n    print({name!r}, repr({expression}))\nexcept OSError as e:\n"
        code += f"    print({name!r}, type(e).__name__)\n"
    result = run(code, config, timeout_s=10)
    lines = result.output.splitlines()
    assert len(lines) == len(attempts), result.output
    seen = {name: line[len(name) + 1:] for name, line in zip(attempts, lines)}

    if mode == "namespaces":  # of the host only the interpreter's files, under their own names
        view = sandbox._view(config.python, config.network)
        targets = [target for _, target in view["binds"]] + list(view["links"])

        def listing(directory):  # what the sandbox shows there: each target's next component
            names = {t[len(directory) + 1:].split("/")[0]
                     for t in targets if t.startswith(directory + "/")}
            return sorted(names) if names else "FileNotFoundError"

        for name in ("secret", "secret via /proc/self/root", "its .git", "/sys/class/net",
                     "boot id", "other runs"):
            assert seen[name] == "FileNotFoundError", (name, seen[name])
        for name, directory in (("/root", "/root"), ("/home", "/home"), ("checkout", checkout)):
            shown = sorted(eval(seen[name])) if seen[name].startswith("[") else seen[name]
            assert shown == listing(directory), (name, seen[name])
        mounts = [line.split() for line in eval(seen["mountinfo"]).splitlines()]
        devices = {f"/dev/{n}" for n in ("null", "zero", "full", "random", "urandom")
                   if os.path.exists(f"/dev/{n}")}
        assert {fields[4] for fields in mounts} == {"/", "/tmp", "/dev/shm", "/proc", *devices,
                                                    *(target for _, target in view["binds"])}
        bound = [target for _, target in view["binds"]]
        for host_path in (checkout, os.path.dirname(root_only_file), "/home", "/sys",
                          config.tmp_root):
            if not any(target.startswith(host_path + "/") for target in bound):  # a venv inside
                assert host_path not in seen["mountinfo"], host_path  # the checkout names it
        assert eval(seen["PID 1"]) == ["\0"]  # blanked
    elif LANDLOCK:  # nothing of the host can be opened but the interpreter's files
        for name in attempts:
            assert seen[name] == "PermissionError", (name, seen[name])
    else:  # file permissions only: what `nobody` (or the trainer's user) may read, /sys, /proc
        assert seen["PID 1"] != "FileNotFoundError"  # the host's init
        if os.geteuid() == 0:
            assert seen["secret"] == seen["secret via /proc/self/root"] == "PermissionError"
        assert eval(seen["/sys/class/net"]) == os.listdir("/sys/class/net")
        with open("/proc/sys/kernel/random/boot_id") as f:
            assert eval(seen["boot id"]) == f.read()


def test_control_characters_are_stripped(mode_config):
    _, config = mode_config
    noisy = r"'a\x1b[31mred\x1b[0m\x00b\r\nc\rd\te\x1b]0;title\x07f\x07\x7f\x9b2J\n'"
    clean = "aredb\nc\nd\tef\n"
    result = run(f"""
        import sys
        sys.stdout.write({noisy})
        sys.stdout.flush()
        sys.stdout.buffer.write(b'\\xff\\xfe ok\\n')
    """, config)
    assert result.output == clean + "\ufffd\ufffd ok\n"
    assert result.output_bytes == len(eval(noisy).encode()) + 6  # counted as written
    # the same in both kept halves of a long output
    code = f"import sys\nsys.stdout.write({noisy})\nprint('.' * 10000)\nsys.stdout.write({noisy})"
    result = run(code, config)
    assert result.truncated
    assert result.output.startswith(clean + "...") and result.output.endswith("...\n" + clean)


# ------------------------------------------------------------------------------------------- the trainer is safe


def test_the_run_dies_with_the_trainer(mode_config):
    mode, config = mode_config
    # a killed trainer cannot clean up in "process" mode
    own_root = tempfile.mkdtemp(prefix="sandbox-test-trainer-")
    os.chmod(own_root, 0o711)
    trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sandbox
        from config import SandboxConfig
        config = SandboxConfig(isolation={mode!r}, python={config.python!r}, tmp_root={own_root!r},
                               timeout_s=60)
        sandbox.run_code("import time; time.sleep(60)", config)
    """)], cwd=os.path.dirname(sandbox._THIS_FILE))
    try:
        # the trainer's own runners, by ancestry while it lives: a runner another worker's test
        # starts meanwhile may not be told apart once reparented (its chain read mid-start)
        deadline, ours = time.monotonic() + 10, []
        while not ours and time.monotonic() < deadline:
            ours = [pid for pid in runner_processes() if trainer.pid in ancestors(pid)]
            time.sleep(0.05)
        assert ours, "the sandbox never started"
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 10  # dies, not dies fast: two loaded cores can take seconds
        while any(map(is_runner, ours)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(is_runner, ours))
    finally:
        trainer.kill()
        shutil.rmtree(own_root)


def test_a_broken_sandbox_is_a_result_not_an_exception(tmp_root):
    config = SandboxConfig(isolation="process", python="/nonexistent/python3", tmp_root=tmp_root)
    result = sandbox.run_code("print(1)", config)
    assert (result.ok, result.error) == (False, "sandbox") and result.message.startswith(
        "Error: sandbox failure")
    assert os.listdir(tmp_root) == []


def test_config_is_checked():
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="docker")
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxConfig(timeout_s=0)
