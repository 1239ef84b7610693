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


def test_stream_rows_out_of_bound_names_the_rows_a_failure_sits_at(capsys):
    """A bf16 stream failing its bound at one token's rows is reported with those rows; a clean
    array has none; a non-finite mismatch counts; the report prints the rows under the FAIL."""
    import ml_dtypes
    import numpy as np

    from dsv41_jax import parity

    gs = GoldenSet(golden_set_dirs()[0])
    key = "prefill.block_out.L00"
    gold = gs[key]  # [b, s, hc, dim] bf16
    assert parity.stream_rows_out_of_bound(gold, gold) == ([], int(np.prod(gold.shape[:-1])))
    g = gold.astype(np.float64)
    rms = float(np.sqrt(np.mean(g**2)))
    port = g.copy()
    port[1, 7, 2, 5] += 0.05 * rms  # beyond 2^-7 (|gold| + RMS) unless |gold| > 5.4 RMS
    port[1, 7, 3, 9] -= 0.05 * rms
    assert abs(g[1, 7, 2, 5]) < 5 * rms and abs(g[1, 7, 3, 9]) < 5 * rms
    port[0, 3, 0, 0] = np.inf
    bad, n = parity.stream_rows_out_of_bound(port.astype(ml_dtypes.bfloat16), gold)
    assert bad == [(0, 3, 0), (1, 7, 2), (1, 7, 3)] and n == np.prod(gold.shape[:-1])

    names = [k.removesuffix(".bf16") for k in gs.keys()]  # noqa: SIM118 (a GoldenSet is no dict)
    ported = {k: gs[k] for k in names if k.startswith("prefill.block_out.")}
    ported[key] = port.astype(ml_dtypes.bfloat16)
    assert parity.report(ported, [], set(ported), gs) == 1
    out = capsys.readouterr().out.splitlines()
    i = next(j for j, line in enumerate(out) if line.startswith(key + " "))
    assert out[i].endswith("FAIL")
    assert out[i + 1].strip() == f"3 of {n} rows out of bound: (0, 3, 0), (1, 7, 2), (1, 7, 3)"
    assert sum(line.endswith("FAIL") for line in out) == 1
