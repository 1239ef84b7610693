"""The critical path of a compiled step: the kernels that must run one after another.

`Generator`'s decode program runs as a CUDA graph whose kernels start as soon as the kernels they
read from have finished (XLA's CONCURRENT command-buffer scheduling), and a profiler trace does
not show those kernels one by one. The one-step program ("decode <path>") has the same kernels
run in XLA's default order, one after another, each traced. Its optimized HLO says which kernel
reads which kernel's output, so the longest chain of dependent kernels, each weighted by its
traced time, is the part of the step no concurrency can hide: with a fixed cost per dependent
launch it estimates the graph's step, and its kernels are what a faster step must shorten.

  entry_instructions(hlo_text)   the entry computation's instructions in schedule order
  align(insts, events)           seconds per kernel-launching instruction, from one step's
                                 kernel events in start order (the schedule's order)
  critical_path(insts, seconds)  the longest dependent chain: (seconds, instruction names)
  path_by_source(...)            that chain's time and launches per emitting source line

Only the entry computation is walked: a while loop or call counts as one launch-free node (the
six-layer decode step has none), and in-place buffer reuse adds no edges. Used by
`model_speed.profile_rows`; `python -m benchmarks.critical_path HLO EVENTS` reads an optimized
HLO text (.gz too) and a JSON list of [name, start_ns, duration_ns] events of whole steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import re
import sys
from pathlib import Path

# opcodes of entry instructions that launch GPU kernels (the rest are views, tuples, parameters)
KERNEL_OPS = ("fusion", "custom-call", "sort", "copy")
_INST = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")


@dataclasses.dataclass(frozen=True)
class Inst:
    name: str  # HLO instruction name
    op: str  # opcode
    args: tuple[str, ...]  # operand instruction names
    kernel: str | None  # a Pallas / Triton custom call's kernel name ("fp8_matmul"), else None
    wraps_sort: bool = False  # a fusion whose root is a sort (its kernels are named "sort_...")
    shape: str = ""  # the result shape's text ("bf16[1,5120]{1,0}", or a tuple of such)

    @property
    def launches(self) -> bool:
        return self.op in KERNEL_OPS


def _split_shape(rest: str) -> str:
    """`rest` after "name = ": drop the result shape (a tuple "(...)" or "type[dims]{layout}")."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += (c == "(") - (c == ")")
            if depth == 0:
                return rest[i + 1:].strip()
    return rest.split(" ", 1)[1].strip() if " " in rest else ""


def _sort_roots(hlo_text: str) -> set[str]:
    """The names of the computations whose ROOT instruction is a sort."""
    roots: set[str] = set()
    comp = None
    for line in hlo_text.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            comp = re.sub(r"^(ENTRY )?%?", "", line).split(" ")[0]
        elif comp and line.lstrip().startswith("ROOT "):
            m = _INST.match(line)
            if m and re.match(r"sort\(", _split_shape(m.group(2))):
                roots.add(comp)
    return roots


def entry_instructions(hlo_text: str) -> list[Inst]:
    """The ENTRY computation's instructions of an optimized (scheduled) HLO text, in order."""
    insts: list[Inst] = []
    inside = False
    sort_roots = _sort_roots(hlo_text)
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if not inside:
            continue
        if line.startswith("}"):
            break
        m = _INST.match(line)
        if not m:
            continue
        body = _split_shape(m.group(2))
        op = re.match(r"([\w\-]+)\(", body)
        if op is None:
            continue
        depth, end = 0, len(body)
        for i, c in enumerate(body):
            depth += (c == "(") - (c == ")")
            if depth == 0 and c == ")":
                end = i
                break
        args = tuple(re.findall(r"%([\w.\-]+)", body[:end + 1]))
        kernel = None
        if op.group(1) == "custom-call":
            k = re.search(r'name = \\?"([\w.]+)\\?"', body)
            kernel = k.group(1) if k else None
        calls = re.search(r"calls=%?([\w.\-]+)", body)
        wraps_sort = op.group(1) == "fusion" and calls is not None and calls.group(1) in sort_roots
        insts.append(Inst(m.group(1), op.group(1), args, kernel, wraps_sort, m.group(2)[:len(m.group(2)) - len(body)]))
    if not insts:
        raise ValueError("no ENTRY computation in the HLO text")
    return insts


# helper kernels that run before the kernel they serve (a sort's copy of its operand, a memset)
_LEADING = re.compile(r"(memcpy|memset)", re.IGNORECASE)
# kernels XLA emits for fusions (the trace names them after the fusion, numbered otherwise than in
# the HLO text); a sort's passes are "sort_<n>_<m>"
_XLA_EMITTED = re.compile(r"(loop|input|wrapped|gemm|fusion|triton)_|fusion\b")
_SORT = re.compile(r"sort_\d")


def align(insts: list[Inst], events: list[tuple[str, float]]) -> dict[str, float]:
    """One step's kernel events (name, duration), in start order -> duration per kernel-launching
    instruction. Kernels run in schedule order, one event per instruction, each checked by kind: a
    Pallas call's by its kernel name (XLA appends "__N" to repeats), an XLA fusion's by the names
    XLA gives fusion kernels (a fusion around a sort: a sort pass), a library call's or a sort's
    by being neither. Some instructions launch more than one kernel: a copy or memset before a
    kernel counts to the instruction after it, any other kernel that is no fusion's and no Pallas
    kernel's (a cuBLAS call's second kernel, a sort's second pass) to the instruction before it.
    An event of the wrong kind, or one left over, raises ValueError: the trace is not this HLO's
    schedule."""
    kernels = [i for i in insts if i.launches]
    if len(events) < len(kernels):
        raise ValueError(f"{len(events)} kernel events for {len(kernels)} kernel-launching instructions")
    pallas = {i.kernel for i in kernels if i.kernel}

    def base(name):
        return re.sub(r"__\d+$", "", name)

    def helper(name):
        return not _LEADING.match(name) and base(name) not in pallas and not _XLA_EMITTED.match(name)

    def fits(inst, name):
        if inst.kernel:
            return base(name) == inst.kernel
        if inst.op == "fusion":
            return bool(_SORT.match(name)) if inst.wraps_sort else bool(_XLA_EMITTED.match(name))
        return inst.op == "copy" or helper(name)

    def expected(inst):
        if inst.kernel:
            return f"kernel {inst.kernel!r}"
        return "a sort's kernel" if inst.wraps_sort else f"a {inst.op}'s kernel"

    out: dict[str, float] = {}
    j, pending, last = 0, 0.0, None
    for inst in kernels:
        checked = inst.kernel is not None or inst.op == "fusion"
        while j < len(events):
            name, dur = events[j]
            if fits(inst, name):
                break
            if _LEADING.match(name) and inst.op != "copy":
                pending += dur
            elif checked and last is not None and helper(name):
                out[last] += dur
            else:
                break
            j += 1
        if j == len(events):
            raise ValueError(f"the kernel events end before {inst.name}, the schedule's kernel {len(out) + 1}")
        name, dur = events[j]
        if not fits(inst, name):
            raise ValueError(f"event {j} is {name!r}, the schedule has {inst.name} ({expected(inst)})")
        out[inst.name] = out.get(inst.name, 0.0) + dur + pending
        j, pending, last = j + 1, 0.0, inst.name
    left = [e for e in events[j:] if not helper(e[0])]
    if left:
        raise ValueError(f"{len(left)} kernel events left over after the schedule's last kernel ({left[0][0]!r})")
    for name, dur in events[j:]:
        out[last] += dur
    return out


def critical_path(insts: list[Inst], seconds: dict[str, float], per_launch: float = 0.0) -> tuple[float, list[str]]:
    """The longest chain through the operand edges, each kernel-launching instruction weighing its
    seconds plus `per_launch` -> (the chain's weight, its kernel-launching instructions in order).
    The schedule order is topological, so one pass suffices."""
    best: dict[str, float] = {}
    prev: dict[str, str | None] = {}
    for inst in insts:
        b, p = 0.0, None
        for a in inst.args:
            if a in best and best[a] > b:
                b, p = best[a], a
        best[inst.name] = b + ((seconds.get(inst.name, 0.0) + per_launch) if inst.launches else 0.0)
        prev[inst.name] = p
    if not best:
        return 0.0, []
    end: str | None = max(best, key=best.get)
    total = best[end]
    by_name = {i.name: i for i in insts}
    path = []
    while end is not None:
        if by_name[end].launches:
            path.append(end)
        end = prev[end]
    return total, path[::-1]


def kernel_label(inst: Inst) -> str:
    """A label for an instruction without a known source line: its Pallas kernel's name, else
    its name without the numeric suffix ("input_reduce_fusion.62" -> "input_reduce_fusion")."""
    return inst.kernel or re.sub(r"[._]\d+$", "", inst.name)


def path_by_source(path: list[str], insts: list[Inst], seconds: dict[str, float],
                   source_of) -> dict[str, tuple[float, int]]:
    """Seconds and launches on the path per source (`source_of(inst)`: a label, e.g. the emitting
    project line from `model_speed.hlo_sources`), largest first."""
    by_name = {i.name: i for i in insts}
    out: dict[str, tuple[float, int]] = {}
    for name in path:
        label = source_of(by_name[name])
        t, n = out.get(label, (0.0, 0))
        out[label] = (t + seconds.get(name, 0.0), n + 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def steps_of(events: list[tuple[str, float, float]], steps: int) -> list[list[tuple[str, float]]]:
    """Kernel events (name, start, duration) of `steps` identical steps -> per step, (name,
    duration) in start order. Raises ValueError when they do not split evenly."""
    ordered = sorted(events, key=lambda e: e[1])
    if steps < 1 or len(ordered) % steps:
        raise ValueError(f"{len(ordered)} kernel events do not split into {steps} equal steps")
    n = len(ordered) // steps
    return [[(e[0], e[2]) for e in ordered[s * n:(s + 1) * n]] for s in range(steps)]


def mean_seconds(insts: list[Inst], steps: list[list[tuple[str, float]]]) -> dict[str, float]:
    """`align` of each step, averaged."""
    total: dict[str, float] = {}
    for step in steps:
        for k, v in align(insts, step).items():
            total[k] = total.get(k, 0.0) + v / len(steps)
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hlo", help="optimized HLO text of the profiled program (.gz allowed)")
    p.add_argument("events", help="JSON list of [name, start_ns, duration_ns] kernel events of whole steps (.gz "
                                  "allowed; model_speed's events_*.json.gz)")
    p.add_argument("--steps", type=int, default=1, help="how many steps the events hold")
    p.add_argument("--per-launch-us", type=float, default=0.0, help="cost added per dependent launch")
    p.add_argument("--top", type=int, default=20)
    ns = p.parse_args(argv)
    try:
        raw = Path(ns.hlo).read_bytes()
        insts = entry_instructions((gzip.decompress(raw) if ns.hlo.endswith(".gz") else raw).decode())
    except (OSError, ValueError) as e:
        p.error(f"{ns.hlo}: not an optimized HLO text with an ENTRY computation ({type(e).__name__}: {e})")
    try:
        raw = Path(ns.events).read_bytes()
        raw = gzip.decompress(raw) if ns.events.endswith(".gz") else raw
        events = [(str(e[0]), e[1] * 1e-9, e[2] * 1e-9) for e in json.loads(raw)]
    except (OSError, ValueError, TypeError, IndexError) as e:
        p.error(f"{ns.events}: not a JSON list of [name, start_ns, duration_ns] events ({type(e).__name__}: {e})")
    try:
        secs = mean_seconds(insts, steps_of(events, ns.steps))
    except ValueError as e:
        p.error(f"{ns.events}: {e}")
    total, path = critical_path(insts, secs, ns.per_launch_us * 1e-6)
    n_kernels = sum(i.launches for i in insts)
    print(f"{len(path)} of {n_kernels} kernels on the critical path: {sum(secs[k] for k in path) * 1e6:.1f} us of "
          f"{sum(secs.values()) * 1e6:.1f} us kernel time; with {ns.per_launch_us} us a launch {total * 1e6:.1f} us")
    for label, (t, n) in list(path_by_source(path, insts, secs, kernel_label).items())[:ns.top]:
        print(f"  {label:<48} {t * 1e6:9.1f} us {n:4d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
