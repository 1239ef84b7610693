"""Shared fixtures. Golden sets: every directory under tests/data/golden/ holding an expected.npz,
plus any directories listed in DSV41_EXTRA_GOLDEN (os.pathsep-separated, same layout)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import ClassVar

import jax
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


def max_routed_scale_byte(hub_dir) -> int:
    """The largest e8m0 byte of a hub checkpoint's backbone routed-expert scales
    (`layers.*.ffn.experts.*.scale`), read from the tensors themselves."""
    from dsv41_jax.checkpoint import HubCheckpoint

    hub = HubCheckpoint(hub_dir)
    return max(int(hub.get(n).view("uint8").max()) for n in hub.names()
               if n.startswith("layers.") and ".ffn.experts." in n and n.endswith(".scale"))


class Child:
    """A Python subprocess whose stdout / stderr go to temporary files (a chatty child never
    blocks on a full pipe). `wait` returns (exit status, stdout, stderr); past the timeout the
    child is killed (status -9)."""

    running: ClassVar[list[Child]] = []

    def __init__(self, argv: list[str], env: dict, cwd: Path):
        # files that outlive this call: read in `wait`, closed when the object goes
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._out, stderr=self._err, text=True)
        Child.running.append(self)

    def wait(self, timeout: float) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.seek(0)
        self._err.seek(0)
        return self.proc.returncode, self._out.read(), self._err.read()


_SESSION_CACHE: list[str] = []  # the compilation cache directory this session made (removed at its end)


def pytest_configure(config):
    """One XLA compilation cache per test session, unless JAX_COMPILATION_CACHE_DIR names one: a
    test that builds a program another test already compiled (a fresh Generator or jit wrapper
    over the same model and shapes) reads the executable back instead of compiling it again, and
    the subprocesses (which inherit the environment) share it. Executables are keyed by their
    whole HLO, compile options and devices, so a hit is the same program."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = tempfile.mkdtemp(prefix="dsv41-jax-compile-cache-")
    _SESSION_CACHE.append(path)
    os.environ.update({"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_collection_finish(session):
    """Tests marked `fake_devices` read one subprocess per module (`start_child()`, cached, with
    8 fake CPU devices); it starts as soon as collection has selected one of them, so it runs
    beside the rest of the suite instead of inside its first test."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under pytest-xdist a worker runs only some modules: each starts its child when first read
    for item in session.items:
        if item.get_closest_marker("fake_devices"):
            item.module.start_child()  # cached: one subprocess per module


def pytest_sessionfinish(session):
    for child in Child.running:  # a run stopped early (-x, Ctrl-C) leaves no stray process
        if child.proc.poll() is None:
            child.proc.kill()
    for path in _SESSION_CACHE:
        shutil.rmtree(path, ignore_errors=True)
