"""Shared fixtures. Golden sets: every directory under tests/data/golden/ holding an expected.npz,
plus any directories listed in DSV41_EXTRA_GOLDEN (os.pathsep-separated, same layout)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsv41_jax.parity import GoldenSet

DATA = Path(__file__).parent / "data"
GOLDEN_ROOT = DATA / "golden"


def golden_set_dirs() -> list[Path]:
    dirs = sorted(p for p in GOLDEN_ROOT.iterdir() if (p / "expected.npz").exists())
    for extra in os.environ.get("DSV41_EXTRA_GOLDEN", "").split(os.pathsep):
        if not extra:
            continue
        p = Path(extra)
        if not (p / "expected.npz").exists() or not (p / "config.json").exists():
            raise FileNotFoundError(f"DSV41_EXTRA_GOLDEN entry {p} has no expected.npz/config.json")
        dirs.append(p)
    return dirs


GOLDEN_DIRS = golden_set_dirs()


@pytest.fixture(params=GOLDEN_DIRS, ids=[p.name for p in GOLDEN_DIRS], scope="session")
def golden(request) -> GoldenSet:
    return GoldenSet(request.param)
