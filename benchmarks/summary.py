"""The speed table of a results file: the latest measurement of each row the suite reports.

`benchmarks/results/h200.json` collects the rows of many runs (each row tagged `run`, `part`);
a row's latest value is the one of the highest run. This prints, as a markdown table: decode at
batch 1, 8, 64, 256 and contexts 4k / 64k (`Generator`'s loop program, "decode fast loop"),
prefill of 4k / 16k tokens ("prefill fast"), each layer role alone ("layer fast <i> <role>
loop"), each with its fraction of the ceiling measured in the same run and the goal where the
suite has one; then the plain jnp path's speed-up, taken only from a run that timed both paths.
A first line names the card (and jax version) of the file's runs, from its `meta.runs`.

  python -m benchmarks.summary [benchmarks/results/h200.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "h200.json"
# (name, batch, context) -> goal as a fraction of the row's ceiling (None: reported, no goal)
DECODE = [("decode fast loop", b, c) for c in (4096, 65536) for b in (1, 8, 64, 256)]
PREFILL = [("prefill fast", 1, s) for s in (4096, 16384)]
GOALS = {("decode fast loop", 1): 0.75, ("decode fast loop", 64): 0.80, ("prefill fast", 1): 0.55}


def latest(rows: list[dict], name: str, batch: int, context: int) -> dict | None:
    """The row of that name, batch and context from the highest run (and part) that measured it;
    of several in one part, the last (a part's rows are in the order they were measured)."""
    hits = [(i, r) for i, r in enumerate(rows) if r.get("name") == name and r.get("batch") == batch
            and r.get("context") == context and r.get("seconds") is not None]
    return max(hits, key=lambda h: (h[1].get("run", 0), str(h[1].get("part") or ""), h[0]))[1] if hits else None


def layer_names(rows: list[dict]) -> list[str]:
    """The per-role layer loop rows' names ("layer fast 0 window loop", ...), in layer order."""
    names = {r["name"] for r in rows if re.fullmatch(r"layer fast \d+ .+ loop", r.get("name", ""))}
    return sorted(names, key=lambda n: int(n.split()[2]))


def table(rows: list[dict]) -> list[dict]:
    """One entry per reported row: name, batch, context, seconds, fraction, ceiling, run, part, goal."""
    out = []
    keys = DECODE + PREFILL + [(n, b, 4096) for n in layer_names(rows) for b in (1, 64)]
    for name, batch, context in keys:
        r = latest(rows, name, batch, context)
        if r is None:
            continue
        out.append({"name": name, "batch": batch, "context": context, "seconds": r["seconds"],
                    "fraction": r.get("fraction_of_ceiling"), "ceiling": r.get("ceiling", "hbm"),
                    "run": r.get("run"), "part": r.get("part"), "goal": GOALS.get((name, batch))})
    return out


def speedups(rows: list[dict]) -> list[dict]:
    """Per (batch, context): the fast loop over the plain jnp loop, from the latest run that
    measured both (a speed-up is only quoted within one run)."""
    out = []
    pairs = {(r["batch"], r["context"]) for r in rows if r.get("name") == "decode reference loop"}
    for batch, context in sorted(pairs):
        runs = {}
        for r in rows:
            if (r.get("batch"), r.get("context")) == (batch, context) and r.get("seconds") is not None and \
                    r.get("name") in ("decode fast loop", "decode reference loop"):
                runs.setdefault(r.get("run"), {})[r["name"]] = r["seconds"]
        both = [run for run, v in runs.items() if len(v) == 2]
        if both:
            run = max(both)
            fast, ref = runs[run]["decode fast loop"], runs[run]["decode reference loop"]
            out.append({"batch": batch, "context": context, "run": run, "fast_s": fast, "reference_s": ref,
                        "speedup": ref / fast})
    return out


def _time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s >= 0.1 else f"{s * 1e6:.1f} µs"


def devices(meta: dict) -> str:
    """'<device> (jax <version>): runs <numbers>' for each device the results' runs name
    (`meta.runs`), so a table says which card its numbers came from; '' without run metadata."""
    by = {}
    for run, info in sorted((meta or {}).get("runs", {}).items(), key=lambda kv: int(kv[0])):
        key = (info.get("device") or "unknown device", info.get("jax"))
        by.setdefault(key, []).append(int(run))
    return "; ".join(f"{dev}{f' (jax {jax})' if jax else ''}: runs {_spans(runs)}" for (dev, jax), runs in by.items())


def _spans(runs: list[int]) -> str:
    """Ascending run numbers [1, 2, 3, 5] -> '1-3, 5'."""
    out = []
    for n in runs:
        if out and n == out[-1][1] + 1:
            out[-1][1] = n
        else:
            out.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


def markdown(rows: list[dict], measured_on: str = "") -> str:
    """The table; `measured_on` (`devices` of the file's meta) heads it where not empty."""
    lines = ["| row | batch | context | time | of ceiling | goal | run |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    if measured_on:
        lines = [f"Measured on {measured_on}.", ""] + lines
    for t in table(rows):
        frac = f"{t['fraction']:.1%} of {t['ceiling']}" if t["fraction"] is not None else "-"
        goal = f"{t['goal']:.0%}" if t["goal"] else ""
        lines.append(f"| {t['name']} | {t['batch']} | {t['context']} | {_time(t['seconds'])} | {frac} | {goal} | "
                     f"{t['run']}{t['part'] or ''} |")
    lines.append("\nGoals: decode batch 1 >= 75% of the copy bandwidth per layer (the row is the whole step, "
                 "the head included), batch 64 >= 80%, prefill >= 55% of the bf16 GEMM rate.")
    sp = speedups(rows)
    if sp:
        lines += ["", "| plain jnp path over the fast path (one run) | batch | context | fast | plain jnp | speed-up |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        lines += [f"| run {s['run']} | {s['batch']} | {s['context']} | {_time(s['fast_s'])} | "
                  f"{_time(s['reference_s'])} | {s['speedup']:.2f}x |" for s in sp]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="?", default=str(RESULTS), help="a results JSON ({'rows': [...]})")
    ns = p.parse_args(argv)
    try:
        data = json.loads(Path(ns.results).read_text())
        rows, measured_on = data["rows"], devices(data.get("meta") or {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        p.error(f"{ns.results}: not a results file with a 'rows' list and run metadata "
                f"({type(e).__name__}: {e})")
    print(markdown(rows, measured_on))
    return 0


if __name__ == "__main__":
    sys.exit(main())
