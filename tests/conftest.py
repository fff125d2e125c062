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


# Tests that share a module-scoped fixture costing an engine or a run go to one pytest-xdist worker
# (pytest.ini: --dist loadgroup), so that the fixture is made once; the rest spread freely.
SHARED_FIXTURES = {"every_method", "one_process"}
SHARED_MODULES = {"test_rollout", "test_tool_rollout"}


def pytest_collection_modifyitems(items):
    for item in items:
        shared = SHARED_FIXTURES & set(item.fixturenames)
        if shared or item.path.stem in SHARED_MODULES:
            group = f"{item.path.stem}.{min(shared)}" if shared else item.path.stem
            item.add_marker(pytest.mark.xdist_group(group))
