"""Shared fixtures. The tiny default (tokenizer, model, tasks; ~90 s) is built once per test session."""

import pytest

import tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tiny")
    tiny.build_tiny(out_dir)
    return out_dir
