"""What this machine offers the sandbox's tests, decided from the machine itself, never by a trial
run of the sandbox (one that failed under load skipped the tests it should have run): a sandbox
that then fails, fails its tests with its own reason."""

import os
import subprocess
import sys

import pytest

import sandbox
from config import SandboxConfig


def usable_python(mode, tmp_root):
    """The interpreter the sandbox runs in this mode. In "process" mode under root the run's own
    user must reach it, and this machine's pyenv may live under /root: then the system one. None:
    no interpreter here that mode can use."""
    for python in (sys.executable, "/usr/bin/python3"):
        if not os.path.exists(python):
            continue
        if mode == "process" and os.geteuid() == 0 and sandbox._out_of_reach(
                python, sandbox._view(python, SandboxConfig().network), tmp_root):
            continue
        return python
    return None


def skip_without_namespaces():
    """Skip where this kernel refuses the namespaces the sandbox makes (e.g. under Docker's seccomp
    profile), as the kernel says to a child that asks for them."""
    ask = ("import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True); "
           f"sys.exit(0 if libc.unshare({0x10000000 | 0x20000000 | 0x20000}) == 0 "
           "else ctypes.get_errno())")  # CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS
    code = subprocess.run([sys.executable, "-c", ask], timeout=60).returncode
    if code:
        pytest.skip(f"user namespaces are not available on this machine: unshare: "
                    f"{os.strerror(code)}")
