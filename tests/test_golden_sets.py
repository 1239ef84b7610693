"""Golden-set discovery: the shipped sets plus DSV41_EXTRA_GOLDEN directories."""

import os

import pytest

from conftest import GOLDEN_ROOT, golden_set_dirs
from dsv41_jax.parity import GoldenSet


def test_shipped_sets_are_discovered():
    names = [p.name for p in golden_set_dirs()]
    assert {"tiny-a", "tiny-c"} <= set(names)


def test_extra_golden_directories_are_appended(monkeypatch, tmp_path):
    extra = GOLDEN_ROOT / "tiny-a"
    monkeypatch.setenv("DSV41_EXTRA_GOLDEN", os.pathsep.join([str(extra), ""]))
    dirs = golden_set_dirs()
    assert dirs[-1] == extra and len(dirs) == len(list(GOLDEN_ROOT.glob("*/expected.npz"))) + 1


def test_extra_golden_directory_without_expected_arrays_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV41_EXTRA_GOLDEN", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="DSV41_EXTRA_GOLDEN entry"):
        golden_set_dirs()
    with pytest.raises(FileNotFoundError, match="missing expected.npz"):
        GoldenSet(tmp_path)
