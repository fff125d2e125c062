"""Scripts of this repository (train.py, tests/nan_train.py, ...) run as `python SCRIPT ARGS` (or
`python -m MODULE ARGS`) or as torchrun's ranks would run them, but forked from a server that has already imported what every run
imports (torch, transformers, vLLM and this repository's modules): a run then starts in well under a
second instead of the ~15 s its imports take, the largest fixed cost of the suite.

What differs from a fresh interpreter is only when the imports happened. A run gets its own
environment (plus what the imports set in the server's, as they would have in its own), working
directory, argv, stdout and stderr; the script or module runs as __main__ (runpy) and exits as the
interpreter would (SystemExit's code, 1 and a traceback on an exception), through
runs.exit_process. torchrun's ranks get torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT...). The README's own commands stay covered by tests that start a
fresh interpreter or torchrun.

One server per pytest worker, started at its first use: `python tests/forked.py`, which reads one
JSON request a line on stdin and answers on stdout."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Runs:
    """The server, seen from a test: forks, and what the forks became."""

    def __init__(self):
        self.server = None

    def ask(self, **request):
        if self.server is None or self.server.poll() is not None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            self.server = subprocess.Popen(
                [sys.executable, __file__], cwd=REPO, env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        answer = self.server.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork server exited ({self.server.wait()}) before answering "
                               f"{request['op']}")
        return json.loads(answer)


_runs = Runs()


class Forked:
    """A run's processes (one per rank), as subprocess.Popen shows one: pid (rank 0's), pids,
    poll(), wait(timeout), send_signal(), returncode (rank 0's, or the first rank's that failed,
    as torchrun fails when one of its ranks does)."""

    def __init__(self, script, args, env, cwd=REPO, nproc=1, stdout=None, stderr=None):
        """script: a path, or "-m" and a module name (python -m)."""
        env = dict(env)
        if nproc > 1:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                       LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK="0", NODE_RANK="0")
        self.pids = [
            _runs.ask(op="start", script=str(script), args=[str(a) for a in args], cwd=str(cwd),
                      stdout=str(stdout or os.devnull), stderr=str(stderr or os.devnull),
                      env={**env, **({"RANK": str(rank), "LOCAL_RANK": str(rank)}
                                     if nproc > 1 else {})})["pid"]
            for rank in range(nproc)]
        self.pid = self.pids[0]
        self.codes = [None] * nproc

    @property
    def returncode(self):
        if None in self.codes:
            return None
        return next((code for code in self.codes if code != 0), 0)

    def poll(self):
        for rank, pid in enumerate(self.pids):
            if self.codes[rank] is None:
                self.codes[rank] = _runs.ask(op="poll", pid=pid)["code"]
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.pids, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, number):
        for pid in self.pids:
            try:
                os.kill(pid, number)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)


def run(script, args, env=None, cwd=REPO, nproc=1, timeout=900):
    """subprocess.run(..., capture_output=True, text=True) of `python script args`, forked; with
    nproc > 1, as torchrun --standalone --nproc_per_node nproc runs it (stdout and stderr are the
    ranks' together)."""
    env = os.environ if env is None else env
    with tempfile.TemporaryDirectory(prefix="forked-") as folder:
        stdout, stderr = Path(folder) / "stdout", Path(folder) / "stderr"
        process = Forked(script, args, env, cwd, nproc, stdout, stderr)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        return subprocess.CompletedProcess([script, *args], process.returncode,
                                           stdout.read_text(), stderr.read_text())


# ------------------------------------------------------------------------------------- the server


def _serve():
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print must not reach the answers
    before = dict(os.environ)
    import runs
    import train  # noqa: F401  (torch, transformers and this repository's modules)
    import vllm.entrypoints.llm  # noqa: F401  (the engine's, imported by rollout.build_engine)
    import torch.distributed.checkpoint  # noqa: F401  (checkpoints.py's, at the first save)
    import vllm.model_executor.models.qwen2  # noqa: F401  (the tiny models' architecture)
    # not vLLM's CPU worker: importing it patches torch (CUDA events and streams, pin_memory),
    # which a run must see only once its engine starts, as in a fresh interpreter

    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            server, pid = os.getpid(), os.fork()
            if pid == 0:
                answers.close()
                runs.exit_process(_child(request, set_by_imports, server))
            answer = {"pid": pid}
        else:
            pid, status = os.waitpid(request["pid"], os.WNOHANG if request["op"] == "poll" else 0)
            answer = {"code": os.waitstatus_to_exitcode(status) if pid else None}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def _child(request, set_by_imports, server):
    import ctypes
    import runpy
    import traceback

    import torch

    # a run dies with the server (whose stdin closes when its pytest worker ends), as a
    # subprocess's run ends with a killed test
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != server:
        return 1

    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **request["env"]})
    tempfile.tempdir = None  # TMPDIR as this run's environment says
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    script, args = request["script"], request["args"]
    try:
        if script == "-m":  # python -m: the working directory first on the path
            sys.path[0] = os.getcwd()
            sys.argv = [*args]
            runpy.run_module(args[0], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(script))
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    _serve()
