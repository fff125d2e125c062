"""Shared fixtures. The tiny default (tokenizer, model, tasks; ~5 min pinned) and its countdown
variant are built once per test session, or reused from $STARE_TINY_DIR when that is set (tiny.py
keeps a complete directory), to save the build between runs."""

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
    """The tiny default with its countdown variant (tiny.build_tiny_countdown: 1,500 pinned
    one-thread warm-up steps, 10-20 min; reused when complete)."""
    tiny.build_tiny_countdown(tiny_dir)
    return tiny_dir
