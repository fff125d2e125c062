"""Shared fixtures. The tiny default (tokenizer, model, tasks) and its variants are obtained once
per test session from the committed reference weights (tiny.ASSETS: seconds), or reused from
$STARE_TINY_DIR when that is set (tiny.py keeps a complete directory)."""

import os
from pathlib import Path

import pytest

import tiny


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


# pytest-xdist (pytest.ini: --dist loadgroup) spreads tests over workers, except for groups kept on
# one worker: tests sharing a module-scoped fixture that costs an engine or a run (made once), and
# every test that runs sandboxed code (the sandbox tests look for stray sandboxed processes
# machine-wide).
SHARED_FIXTURES = {"every_method", "one_process"}
MODULE_GROUPS = {"test_rollout": "test_rollout", "test_sandbox": "sandbox",
                 "test_tool_rollout": "sandbox"}
SANDBOXED_TESTS = {"test_tool_use_trains_end_to_end_with_tool_tokens_masked",
                   "test_a_sandbox_that_cannot_run_stops_the_run_before_the_engine"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        shared = SHARED_FIXTURES & set(item.fixturenames)
        group = (f"{item.path.stem}.{min(shared)}" if shared
                 else "sandbox" if item.originalname in SANDBOXED_TESTS
                 else MODULE_GROUPS.get(item.path.stem))
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
