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

