"""Streaming writer: hub shards -> Orbax groups laid out for the mesh, one group in memory at a time.

Per group (see `convert.plan`): each parameter is assembled in a fresh host buffer of its final
dtype (stacked experts copied expert by expert, bf16 widened, fp8 / fp4 dequantised where the
plan says so), then one synchronous Orbax PyTree save writes the group and the buffers are
dropped. Orbax writes an array only from a whole in-memory value, so the group (at most one
layer's stacked w1 with its scales, or the head) is the memory in flight. The Engram
tables, larger than a host's RAM, are the exception: they are copied row block by row block
into zarr3 arrays with tensorstore, followed by the zero rows that pad them to a multiple of the
mesh's split (`Leaf.pad_rows`, see `convert.plan`).

Layout on the mesh: each array is its own zarr directory (Orbax without OCDBT); every dim that
a parameter's rule shards is stored in chunks of one index along it (Orbax
`SaveArgs.shard_axes`), other dims in chunks of at most 64 MiB, so on any mesh with those axes
each device reads exactly the chunks of its own shard on restore; the PartitionSpec of every
parameter on the requested mesh is recorded in the manifest.

Why host numpy buffers and not jax.Arrays sharded on (fake) devices: Orbax first copies a
jax.Array to the host (`copy_to_host_async`), and deep-copies numpy values against mutation
during an async save; either copy doubles the memory in flight. The buffers here are handed over
as `_HostBuffer`, an ndarray whose deepcopy is itself: the save is synchronous and the buffer
is never mutated, so the copy protects nothing.

Source pages: hub tensors are memory-mapped views; a page read through a mapping counts in the
process RSS until unmapped, so after each copy the mapping's pages are released
(`madvise(MADV_DONTNEED)`, which only drops this process's page-table entries; the data stays in
the page cache and later reads fault it back).

Atomicity and resume: everything is written under `OUT.partial/`; `run.json` there pins the
source (index digest, shard sizes), the dtype mode and the mesh; after a group is written, its
files are read back and their SHA-256 digests go with the group's record to
`progress/<group>.json`. `--resume` re-checks the run identity, skips each group whose record
matches the plan and whose files (every file under the group's directories, none missing, none
added) still have the recorded digests, and rewrites any other, so a group damaged on disk is
redone. Only when every group is written do `config.json`, `engram_map.npy` and `manifest.json`
(with one digest per group, over its files' digests) appear, and `OUT.partial` is renamed to
`OUT` in one step, so a crash never leaves a directory that loads as complete.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import mmap
import os
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from convert.plan import ConversionError, Group, Leaf, Plan
from dsv41_jax import checkpoint_io as cio
from dsv41_jax import quant
from dsv41_jax.checkpoint import HubCheckpoint

__all__ = ["PARTIAL_SUFFIX", "group_digest", "peak_rss_bytes", "rss_bytes", "write_plan"]

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
RUN_FILE = "run.json"
PROGRESS_DIR = "progress"
ORBAX_CHUNK_BYTES = 64 << 20  # storage chunk limit along the unsharded dims
TABLE_CHUNK_BYTES = 16 << 20  # zarr chunk of a table


# ------------------------------------------------------------------------------------ memory


def rss_bytes() -> int | None:
    """Current resident set size of this process (Linux /proc), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int:
    """Peak RSS of this process so far (getrusage; KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _release_pages(a: np.ndarray) -> None:
    """Drop the pages of the memory map under `a` from this process (no-op for heap arrays)."""
    base = a
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    if base is not None and hasattr(mmap, "MADV_DONTNEED"):
        base.madvise(mmap.MADV_DONTNEED)


# ------------------------------------------------------------------------------------ reading


class _Reader:
    """Reads hub tensors into parameter buffers and counts every name it reads."""

    def __init__(self, ckpt: HubCheckpoint, chunk_bytes: int, on_bytes: Callable[[int], None]):
        self.ckpt = ckpt
        self.chunk_bytes = chunk_bytes
        self.on_bytes = on_bytes
        self.consumed: collections.Counter = collections.Counter()

    def get(self, name: str) -> np.ndarray:
        """The hub tensor (memory-mapped view), counted as consumed."""
        self.consumed[name] += 1
        return self.ckpt.get(name)

    def _copy_rows(self, dst: np.ndarray, src: np.ndarray) -> None:
        """dst[...] = src (cast to dst.dtype) in row chunks, releasing source pages per chunk."""
        if src.ndim == 0 or src.shape[0] == 0:
            dst[...] = src
            return
        row_bytes = max(1, src.nbytes // src.shape[0])
        step = max(1, self.chunk_bytes // row_bytes)
        for r in range(0, src.shape[0], step):
            np.copyto(dst[r:r + step], src[r:r + step], casting="unsafe" if dst.dtype != src.dtype else "no")
            _release_pages(src)
            self.on_bytes(src[r:r + step].nbytes)

    def fill(self, leaf: Leaf) -> np.ndarray:
        """The parameter's value as a fresh host array of its dtype and shape."""
        buf = np.empty(leaf.shape, leaf.dtype)
        for i, name in enumerate(leaf.sources):
            dst = buf[i] if leaf.stacked else buf
            src = self.get(name)
            if leaf.how in ("copy", "widen"):
                self._copy_rows(dst, src)
            else:
                scale = self.get(leaf.scales[i])
                fn = quant.dequant_fp8_weight if leaf.how == "dequant_fp8" else quant.dequant_fp4_weight
                dst[...] = np.asarray(fn(jnp.asarray(src), jnp.asarray(scale), jnp.dtype(leaf.dtype)))
                _release_pages(src)
                _release_pages(scale)
                self.on_bytes(src.nbytes + scale.nbytes)
        return buf


# ------------------------------------------------------------------------------------ writing


class _HostBuffer(np.ndarray):
    """A host array Orbax may keep by reference (see the module doc): deepcopy returns itself."""

    def __deepcopy__(self, memo):
        return self


def _write_orbax_group(group: Group, path: Path, reader: _Reader) -> None:
    import orbax.checkpoint as ocp

    values, save_args = {}, {}
    for leaf in group.leaves:
        values[leaf.path] = reader.fill(leaf).view(_HostBuffer)
        sharded = tuple(d for d, entry in enumerate(leaf.spec) if entry is not None)
        save_args[leaf.path] = ocp.SaveArgs(chunk_byte_size=ORBAX_CHUNK_BYTES, shard_axes=sharded)
    # use_ocdbt=False: each array is a zarr directory written chunk by chunk; the OCDBT store
    # buffers a whole save (here: the group again) in memory until it commits
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)  # one "skipping merge of OCDBT checkpoints" warning per save otherwise
    try:
        checkpointer.save(path, args=ocp.args.PyTreeSave(cio.nest(values), save_args=cio.nest(save_args)))
    finally:
        absl_log.setLevel(level)


def _write_table_group(group: Group, root: Path, reader: _Reader) -> None:
    import tensorstore as ts

    for leaf in group.leaves:
        if leaf.how != "copy" or len(leaf.sources) != 1:
            raise ConversionError(f"{leaf.path}: tables are copied bit for bit; the plan asks {leaf.how!r}")
        src = reader.get(leaf.sources[0])
        rows, hub_rows = leaf.shape[0], leaf.shape[0] - leaf.pad_rows
        if tuple(src.shape) != (hub_rows, *leaf.shape[1:]):
            raise ConversionError(f"{leaf.sources[0]}: hub shape {tuple(src.shape)}, the plan expects "
                                  f"{(hub_rows, *leaf.shape[1:])}")
        row_bytes = leaf.nbytes // max(rows, 1)
        byte_shape = (rows, row_bytes)
        chunk_rows = max(1, min(rows, TABLE_CHUNK_BYTES // max(row_bytes, 1)))
        dst = ts.open(cio.table_spec(root / leaf.path, create={"shape": byte_shape,
                                                               "chunk_shape": (chunk_rows, row_bytes)})).result()
        step = chunk_rows * max(1, reader.chunk_bytes // (chunk_rows * row_bytes))
        for r in range(0, hub_rows, step):
            block = np.ascontiguousarray(src[r:r + step]).view(np.uint8).reshape(-1, row_bytes)
            # the block is not touched again before the write completes: no copy into tensorstore's cache
            dst[r:r + block.shape[0]].write(block, can_reference_source_data_indefinitely=True).result()
            _release_pages(src)
            reader.on_bytes(block.nbytes)
        if leaf.pad_rows:
            # padding rows are all-zero bytes (weight 0): they read as zero, as ids outside the table do
            dst[hub_rows:rows].write(np.zeros((leaf.pad_rows, row_bytes), np.uint8)).result()


def _file_digests(group: Group, tmp: Path) -> dict[str, str]:
    """{path relative to `tmp`: SHA-256 hex} of every file the finished group consists of (its
    directories, read back from disk in 1 MiB blocks, so memory stays flat)."""
    digests = {}
    for root in _group_dirs(group, tmp, finished_only=True):
        files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else [root] if root.exists() else []
        for f in files:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            digests[f.relative_to(tmp).as_posix()] = h.hexdigest()
    return digests


def group_digest(file_digests: dict[str, str]) -> str:
    """One SHA-256 over a group's sorted (file, digest) pairs (the manifest's per-group checksum)."""
    return hashlib.sha256("".join(f"{p}\0{d}\n" for p, d in sorted(file_digests.items())).encode()).hexdigest()


def _verified(group: Group, tmp: Path, record_path: Path, expected: dict) -> dict[str, str] | None:
    """The file digests of a group written by an earlier run, if its record matches the plan
    and every file still has its recorded digest; None means: rewrite the group."""
    try:
        done = json.loads(record_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        log.info("group %s: progress record unreadable (%s); rewriting it", group.name, e)
        return None
    recorded = done.pop("files", None) if isinstance(done, dict) else None
    if done != expected or not isinstance(recorded, dict) or not recorded:
        log.info("group %s: progress record differs from the plan; rewriting it", group.name)
        return None
    stored = _file_digests(group, tmp)
    if stored != recorded:
        changed = sorted(p for p in stored.keys() | recorded.keys() if stored.get(p) != recorded.get(p))
        log.warning("group %s: %d stored files differ from their recorded checksums (%s%s); rewriting it",
                    group.name, len(changed), ", ".join(changed[:3]), " ..." if len(changed) > 3 else "")
        return None
    return stored


def _group_dirs(group: Group, tmp: Path, *, finished_only: bool = False) -> list[Path]:
    """Everything a group may have left: its arrays, and Orbax's temporary directory of a save
    that was cut off (`<name>.orbax-checkpoint-tmp-*`, renamed to `<name>` only when complete)."""
    if group.kind == "orbax":
        state = tmp / cio.STATE_DIR
        if finished_only:
            return [state / group.name]
        return [state / group.name, *state.glob(f"{group.name}.orbax-checkpoint-tmp*")]
    return [tmp / cio.TABLES_DIR / leaf.path for leaf in group.leaves]


# ------------------------------------------------------------------------------ run identity


def _run_identity(ckpt: HubCheckpoint, plan: Plan) -> dict:
    shards = {s: os.path.getsize(ckpt.directory / s) for s in ckpt.shards()}
    return {
        "format": cio.FORMAT,
        "version": cio.FORMAT_VERSION,
        "source": str(ckpt.directory.resolve()),
        "index_sha256": hashlib.sha256(ckpt.index_path.read_bytes()).hexdigest(),
        "shard_bytes": shards,
        "config": plan.source_args.to_dict(),
        "dtype_mode": plan.dtype_mode,
        "mesh": plan.mesh_sizes,
    }


def _check_identity(tmp: Path, identity: dict) -> None:
    path = tmp / RUN_FILE
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"--resume: {path} is unreadable ({e}); delete {tmp} and convert from scratch") from None
    diff = [k for k in identity if old.get(k) != identity[k]]
    if diff:
        raise ConversionError(
            f"--resume: the interrupted run in {tmp} differs from this one in {diff} (source, options or "
            f"format changed); delete {tmp} or repeat the original options"
        )


# ----------------------------------------------------------------------------------- driver


def write_plan(plan: Plan, ckpt: HubCheckpoint, out: Path, *, config: dict,
               token_map: np.ndarray | None, resume: bool = False, progress: bool = True,
               chunk_bytes: int = 256 << 20, on_group_done: Callable[[Group], None] | None = None) -> dict:
    """Writes every group of `plan` into `out` (atomically, see the module doc). Returns a summary:
    {"groups_written", "groups_skipped", "bytes", "seconds", "peak_rss", "largest_group_bytes"}."""
    from tqdm import tqdm

    out = Path(out)
    tmp = out.with_name(out.name + PARTIAL_SUFFIX)
    if out.exists():
        raise ConversionError(f"output {out} already exists; choose another --out or remove it")
    identity = _run_identity(ckpt, plan)
    if tmp.exists():
        if not resume:
            raise ConversionError(
                f"{tmp} holds an interrupted conversion; pass --resume to finish it or delete it to start over"
            )
        _check_identity(tmp, identity)
    else:
        if resume:
            log.warning("--resume: no interrupted conversion at %s; starting from scratch", tmp)
        (tmp / PROGRESS_DIR).mkdir(parents=True)
        (tmp / RUN_FILE).write_text(json.dumps(identity, indent=1))

    bar = tqdm(total=plan.source_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="dsv41-convert",
               disable=not progress, smoothing=0.1)
    reader = _Reader(ckpt, chunk_bytes, bar.update)
    written = skipped = 0
    digests: dict[str, str] = {}
    t0 = time.perf_counter()
    try:
        for group in plan.groups:
            record_path = tmp / PROGRESS_DIR / f"{group.name}.json"
            expected = {**group.record(), "consumed": sorted(n for leaf in group.leaves for n in leaf.sources + leaf.scales)}
            if record_path.exists():
                files = _verified(group, tmp, record_path, expected)
                if files is not None:
                    digests[group.name] = group_digest(files)
                    reader.consumed.update(expected["consumed"])
                    bar.update(group.source_bytes)
                    skipped += 1
                    continue
                record_path.unlink()
            for d in _group_dirs(group, tmp):
                if d.exists():
                    shutil.rmtree(d)
            rss = rss_bytes()
            bar.set_postfix_str(f"{group.name}" + (f" rss={rss / 2**30:.1f}GiB" if rss else ""), refresh=False)
            if group.kind == "orbax":
                _write_orbax_group(group, tmp / cio.STATE_DIR / group.name, reader)
            else:
                _write_table_group(group, tmp / cio.TABLES_DIR, reader)
            files = _file_digests(group, tmp)
            digests[group.name] = group_digest(files)
            record_path.write_text(json.dumps({**expected, "files": files}, indent=1))
            written += 1
            if on_group_done is not None:
                on_group_done(group)
    finally:
        bar.close()

    expected_names = set(ckpt.names()) - plan.dropped.keys()
    twice = sorted(n for n, c in reader.consumed.items() if c > 1)
    unread = sorted(expected_names - reader.consumed.keys())
    if twice or unread:
        raise ConversionError(f"internal: coverage broken after writing: read twice {twice[:10]}, never read {unread[:10]}")

    (tmp / cio.CONFIG_FILE).write_text(json.dumps(config, indent=1))
    if token_map is not None:
        np.save(tmp / cio.TOKEN_MAP_FILE, token_map)
    manifest = {
        "format": cio.FORMAT,
        "version": cio.FORMAT_VERSION,
        "complete": True,
        "dtype_mode": plan.dtype_mode,
        "mesh": plan.mesh_sizes,
        "engram_rows_multiple": plan.target_args.engram_rows_multiple,
        "source": identity["source"],
        "groups": [{**g.record(), "sha256": digests[g.name]} for g in plan.groups],
        "dropped": plan.dropped,
        "dropped_summary": plan.dropped_summary(),
        "token_map": cio.TOKEN_MAP_FILE if token_map is not None else None,
    }
    (tmp / cio.MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        raise ConversionError(f"output {out} appeared while converting; the finished result stays in {tmp}")
    os.rename(tmp, out)
    return {
        "groups_written": written,
        "groups_skipped": skipped,
        "bytes": plan.source_bytes,
        "seconds": time.perf_counter() - t0,
        "peak_rss": peak_rss_bytes(),
        "largest_group_bytes": max((_in_flight(g, chunk_bytes) for g in plan.groups), default=0),
    }


def _in_flight(group: Group, chunk_bytes: int) -> int:
    """Host bytes a group holds at once: all its buffers, or one row block for a table."""
    if group.kind == "table":
        return max(min(leaf.nbytes, chunk_bytes) for leaf in group.leaves)
    return group.nbytes
