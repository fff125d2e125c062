"""Shared fixtures. The tiny default (tokenizer, model, tasks; ~90 s) is built once per test session, or reused from
$STARE_TINY_DIR when that is set (tiny.build_tiny keeps a complete directory), to save the build between runs."""

import os
from pathlib import Path

import pytest

import tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    out_dir = os.environ.get("STARE_TINY_DIR") or tmp_path_factory.mktemp("tiny")
    tiny.build_tiny(out_dir)
    return Path(out_dir)
