"""Shared fixtures. Golden sets: every directory under tests/data/golden/ holding an expected.npz,
plus any directories listed in DSV41_EXTRA_GOLDEN (os.pathsep-separated, same layout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

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


class GoldenSet:
    """One golden directory: config, inputs, expected arrays (bf16 keys decoded)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.name = self.path.name
        self._npz = np.load(self.path / "expected.npz")
        self.inputs = json.loads((self.path / "inputs.json").read_text())

    def keys(self):
        return list(self._npz.keys())

    def __contains__(self, key):
        return key in self._npz or key + ".bf16" in self._npz

    def __getitem__(self, key: str) -> np.ndarray:
        """Array by key; a `.bf16` suffix may be omitted (uint16 bit patterns become bfloat16)."""
        import ml_dtypes

        if key in self._npz:
            arr = self._npz[key]
            return arr.view(ml_dtypes.bfloat16) if key.endswith(".bf16") else arr
        return self._npz[key + ".bf16"].view(ml_dtypes.bfloat16)

    @property
    def args(self):
        from dsv41_jax.config import ModelArgs

        rt = self.inputs.get("runtime", {})
        return ModelArgs.from_json(self.path / "config.json", max_batch_size=rt.get("max_batch_size", 4),
                                   max_seq_len=rt.get("max_seq_len", 4096))


GOLDEN_DIRS = golden_set_dirs()


@pytest.fixture(params=GOLDEN_DIRS, ids=[p.name for p in GOLDEN_DIRS], scope="session")
def golden(request) -> GoldenSet:
    return GoldenSet(request.param)
