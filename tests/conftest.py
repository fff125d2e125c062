"""Shared fixtures. The tiny default (tokenizer, model, tasks) and its variants are obtained once
per test session from the committed reference weights (tiny.ASSETS: seconds), or reused from
$STARE_TINY_DIR when that is set (tools/tiny.py keeps a complete directory)."""

import os
from pathlib import Path

import pytest
import torch

from tools import tiny

# several pytest-xdist workers share the cores: one thread per process (and per train.py it
# starts), or OpenMP threads spin waiting for a core the other worker holds
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    out_dir = os.environ.get("STARE_TINY_DIR") or tmp_path_factory.mktemp("tiny")
    tiny.build_tiny(out_dir)
    return Path(out_dir)


@pytest.fixture(scope="session")
def countdown_dir(tiny_dir):
    """The tiny default with its countdown variant (reused when complete)."""
    tiny.build_tiny_countdown(tiny_dir)
    return tiny_dir


@pytest.fixture(scope="session")
def tool_dir(tiny_dir):
    """The tiny default with its tool-use variant, tool_model/ (reused when complete)."""
    tiny.build_tiny_tool(tiny_dir)
    return tiny_dir


# pytest-xdist (pytest.ini: --dist loadgroup) spreads the tests over workers, but keeps on one
# worker the tests that share a fixture costing an engine or a run, so that it is made once.
SHARED_FIXTURES = {"every_method", "default_run", "one_rank_gen16", "one_process",
                   "engine"}


# The modules of the longest tests (runs of train.py, tools' runs, reduced builds) go first, so
# that short tests fill the end and the workers finish together (xdist hands out the ungrouped
# tests in collection order).
LONG_FIRST = ("test_train.py", "test_repro.py", "test_tiny.py")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)  # stable: order kept within
    for item in items:
        shared = SHARED_FIXTURES & set(item.fixturenames)
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.path.stem}.{min(shared)}"))


@pytest.hookimpl(trylast=True)  # after pytest's own clean-up (pytest.ini: tmp_path_retention_policy)
def pytest_sessionfinish(session, exitstatus):
    """A passing run removes its temporary directories, but pytest keeps their parent,
    $TMPDIR/pytest-of-$USER, with a dangling pytest-current link: both go when nothing else is
    there (another session's directories are left alone)."""
    factory = getattr(session.config, "_tmp_path_factory", None)
    basetemp = getattr(factory, "_basetemp", None)
    if exitstatus != 0 or basetemp is None or hasattr(session.config, "workerinput"):
        return
    parent = Path(basetemp).parent
    current = parent / "pytest-current"
    if current.is_symlink() and not current.exists():
        current.unlink()
    try:
        parent.rmdir()
    except OSError:  # not empty, or already gone
        pass
