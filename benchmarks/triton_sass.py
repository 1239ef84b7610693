"""The routed-expert kernel's machine code without a GPU: instruction counts of its K loop.

    pip install -e ".[sass]"   # the triton package: not a project dependency, only this tool uses it
    python -m benchmarks.triton_sass [--variants JSON] [--sites ...] [--json PATH]
    python -m benchmarks.triton_sass --ptx module.ptx [--function REGEX]   # a device's dump
    python -m benchmarks.triton_sass --fp8 '[{"site": "wq_b", "rows": 64, "swap_ab": true}]'  # the dense fp8 kernel

The Pallas kernel (`pallas_kernels.expert_matmul.kernel_gpu`) is lowered for CUDA on this host
(no GPU needed: the Pallas -> Triton IR step is jax's own), and the Triton IR is compiled for
sm_90 by the `triton` package's compiler and `ptxas`, then disassembled. For each site and
variant the tool reports the K loop of the SASS (the block a backward branch repeats, one K step
of the software pipeline): its instructions (per warp, i.e. per thread), the instructions per
fp4 code (a thread's share of the step's codes), the mix (decode: integer and packed-bf16
operations; MMA: HMMA = warp-level mma.sync with register operands, HGMMA = warpgroup wgmma
reading shared memory; STS = stores to shared memory, i.e. a decoded tile on its way to the MMA),
registers, spill traffic (STL / LDL in the loop) and shared memory, the programs an sm_90 SM
holds at once (by registers, shared memory and warps: `programs_per_sm`) and, for the 16-row
decode tiles, the waves a one-token launch's programs (6 pairs x column blocks x K splits) take
on 132 SMs, and the issue bound: the weight bytes a second and MMA FLOP/s the loop could reach
on an H200 (132 SMs at 1.98 GHz, 4 warp instructions a clock an SM) if issuing its instructions
were the only limit (`issue_bound`).

The compiler is the `triton` package's, not the Triton inside the jaxlib that runs the kernel on
a GPU: versions and pass pipelines differ, so the counts describe this compilation; a device's
own code is what to compare them with: `--ptx` assembles a PTX module (XLA's dump on the device,
`XLA_FLAGS=--xla_dump_to=DIR`, holds the jaxlib-compiled Triton kernels) with the same ptxas and
counts the loops of the kernels whose names match `--function`.

Variants are `kernel_gpu.expert_matmul` keyword overrides on top of the model's defaults for the
site (`api.BlockSizes.resolved`), e.g. '[{"decode": "select"}, {"num_warps": 8}]'.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

# site -> (N, K, weights per launch, rows per tile): the released w1 / w3 (fused at decode
# tiles), w2, a prefill-sized tile, and the gather path's one-row programs (`BlockSizes.one_row`)
SITES = {
    "w1+w3 decode": (2304, 5120, 2, 16),
    "w1 decode": (2304, 5120, 1, 16),
    "w2 decode": (5120, 2304, 1, 16),
    "w1 prefill": (2304, 5120, 1, 64),
    "w1+w3 one row": (2304, 5120, 2, 1),
    "w2 one row": (5120, 2304, 1, 1),
}
# the element-wise families the decodes compile to (integer logic, shifts, byte permutes,
# packed-bf16 and fp32 multiplies, conversions, selects)
ALU_OPS = ("LOP3", "SHF", "PRMT", "HMUL2", "HFMA2", "IMAD.SHL", "FMUL", "F2FP", "SEL", "ISETP", "SGXT")
_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)")


def triton_ir(fn, *args) -> list[str]:
    """The Triton IR (text) of every Pallas Triton call in `jax.jit(fn)` lowered for CUDA."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured = []
    original = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = original(*a, **kw)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = original
    return captured


def expert_ir(n: int, k: int, g: int, rows: int, **overrides) -> tuple[str, dict]:
    """(Triton IR, the kernel's keyword arguments) of one expert-kernel launch of `g` weights at the
    model's defaults for `rows` per tile (one weight: `swap_ab` and `one_dot` by
    `BlockSizes.swap_ab_single`), with `overrides`."""
    from pallas_kernels.expert_matmul import api, kernel_gpu

    kw = {"rows": rows, **api.BlockSizes().resolved(rows, n, k, interpret=False, weights=g).kernel_args(),
          **overrides}
    n_exp = 3
    x = jnp.zeros((kw["rows"], k), jnp.bfloat16)
    w = jnp.zeros((n_exp, n, k // 2), jnp.int8)
    s = jnp.zeros((n_exp, n, k // 32), jnp.uint8)
    t = [jnp.asarray([v], jnp.int32) for v in (n_exp - 1, 0, kw["rows"])]
    ws, ss = ((w,) * g, (s,) * g) if g > 1 else (w, s)
    irs = triton_ir(lambda x: kernel_gpu.expert_matmul(x, ws, ss, *t, interpret=False, **kw), x)
    if len(irs) != 1:
        raise RuntimeError(f"expected one Pallas Triton call, lowered {len(irs)}")
    return irs[0], kw


def fuse_dot_add(ir: str) -> tuple[str, int]:
    """(IR, rewrites): each `%r = tt.dot %a, %b, %zero` directly followed by `%s = arith.addf %acc, %r`
    becomes `%s = tt.dot %a, %b, %acc` (the accumulator inside the MMA). Pallas lowers `acc +
    dot(a, b)` to the first form, which this Triton does not combine; the rewrite measures what the
    second would give (the fp32 sums then run in another order)."""
    lines, out, n, i = ir.split("\n"), [], 0, 0
    while i < len(lines):
        dot = re.match(r"(\s+)(%\w+) = tt\.dot (%\w+), (%\w+), %\w+, (.*)$", lines[i])
        add = dot and i + 1 < len(lines) and re.match(
            r"\s+(%\w+) = arith\.addf (%\w+), " + re.escape(dot.group(2)) + r" : ", lines[i + 1])
        if add:
            out.append(f"{dot.group(1)}{add.group(1)} = tt.dot {dot.group(3)}, {dot.group(4)}, {add.group(2)}, "
                       f"{dot.group(5)}")
            n, i = n + 1, i + 2
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out), n


def compile_ir(ir: str, num_warps: int, num_stages: int, capability: int = 90):
    """Triton IR compiled for sm_`capability` by the triton package: the compiled kernel (`.asm`:
    its stages "ptx", "cubin", ...; `.metadata.shared`: its dynamic shared memory in bytes)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ttir"
        src.write_text(ir)
        return triton.compile(str(src), target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})


def compile_sass(ir: str, num_warps: int, num_stages: int, capability: int = 90) -> tuple[str, str, int]:
    """(SASS text, cuobjdump's resource-usage line, dynamic shared memory in bytes) of Triton IR
    compiled for sm_`capability`."""
    kernel = compile_ir(ir, num_warps, num_stages, capability)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass, usage = _disassemble(cubin)
    line = next((ln.strip() for ln in usage.splitlines() if "REG:" in ln), "")
    return sass, line, int(kernel.metadata.shared)


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _disassemble(cubin: Path) -> tuple[str, str]:
    """(SASS, resource usage) of a cubin, by the package's cuobjdump."""
    return tuple(subprocess.run([_tool("cuobjdump"), flag, str(cubin)], check=True, capture_output=True,
                                text=True).stdout for flag in ("--dump-sass", "--dump-resource-usage"))


def sass_of_ptx(ptx: str) -> tuple[str, str]:
    """(SASS, resource usage) of a PTX module (e.g. a device's XLA dump, whose Triton kernels sit
    beside XLA's own), assembled by the triton package's ptxas for the module's `.target`."""
    target = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.MULTILINE)
    if not target:
        raise ValueError("no .target line in the PTX")
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "module.ptx", Path(tmp) / "module.cubin"
        src.write_text(ptx)
        # the package may carry a ptxas per CUDA major version: the newer reads newer PTX
        failed = None
        for tool in (t for t in ("ptxas-blackwell", "ptxas") if Path(_tool(t)).exists()):
            try:
                subprocess.run([_tool(tool), f"-arch={target.group(1)}", "-o", str(cubin), str(src)], check=True,
                               capture_output=True, text=True)
                break
            except subprocess.CalledProcessError as e:
                failed = e
        else:
            raise failed or FileNotFoundError("no ptxas in the triton package")
        return _disassemble(cubin)


def functions(listing: str) -> dict[str, str]:
    """cuobjdump output split by function: its `Function : name` (SASS) or `Function name:`
    (resource usage) headers."""
    out, name = {}, None
    for line in listing.splitlines():
        m = re.match(r"\s*Function\s*(?::\s*(\S+)|(\S+):)\s*$", line)
        if m:
            name = m.group(1) or m.group(2)
            out[name] = ""
        elif name is not None:
            out[name] += line + "\n"
    return out


def loop_stats(sass: str) -> dict:
    """Instruction mix of the innermost loop of a SASS listing: the instructions from the target
    of the first conditional backward branch up to that branch. Opcodes are counted with their
    first modifier for the MMA, shared-memory and decode families (HMMA.16816, LDS.128, ...)."""
    instrs = []  # (address, opcode, modifiers, text)
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2), m.group(3), line))
    for i, (addr, op, _, text) in enumerate(instrs):
        b = re.search(r"@!?P\d+\s+BRA\s+0x([0-9a-f]+)", text)
        if op == "BRA" and b and int(b.group(1), 16) < addr:
            target = int(b.group(1), 16)
            body = [x for x in instrs[:i + 1] if x[0] >= target]
            break
    else:
        raise ValueError("no backward conditional branch (no loop) in the SASS")
    ops = collections.Counter()
    for _, op, mods, _ in body:
        first = mods.split(".")[1] if mods.count(".") >= 1 else ""
        keep = op in ("HMMA", "HGMMA", "LDS", "STS", "LDSM", "IMAD") and first
        ops[f"{op}.{first}" if keep else op] += 1
    return {"instructions": len(body), "ops": dict(ops.most_common())}


def _count(ops: dict, *prefixes: str) -> int:
    return sum(v for k, v in ops.items() if k.startswith(prefixes))


def loop_or_kernel_ops(sass: str) -> tuple[dict, bool]:
    """(`loop_stats` of the SASS, True), or for a kernel without a loop (one K step a program:
    the loop unrolled away) the same counts over the whole kernel, False."""
    try:
        return loop_stats(sass), True
    except ValueError:
        found = [m for m in map(_INSTR.match, sass.splitlines()) if m]
        return {"instructions": len(found), "ops": dict(collections.Counter(m.group(2) for m in found))}, False


def _resources(usage: str) -> tuple[int | None, int | None]:
    """(registers, stack bytes) from cuobjdump's resource-usage line."""
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return (int(regs.group(1)) if regs else None), (int(stack.group(1)) if stack else None)


def _mma(ops: dict) -> dict:
    """The MMA opcodes of a loop's mix (HMMA: mma.sync, HGMMA: wgmma) and their counts."""
    return {k: v for k, v in ops.items() if k.startswith(("HMMA", "HGMMA"))}


# H200 SXM: streaming multiprocessors, the boost clock (GHz); each SM issues at most one warp
# instruction a clock from each of its 4 schedulers
H200_SMS, H200_CLOCK_GHZ, SCHEDULERS = 132, 1.98, 4


def issue_bound(instructions: int, num_warps: int, weight_bytes: int, mma_flops: int, sms: int = H200_SMS,
                clock_ghz: float = H200_CLOCK_GHZ) -> dict:
    """The rates a K loop of `instructions` a warp per step could reach if instruction issue were
    its only limit: the step's warps need num_warps * instructions / 4 clocks of an SM's 4
    schedulers (programs sharing an SM add their steps, so occupancy cancels), for the step's
    `weight_bytes` (packed codes and scales) and `mma_flops`. Upper bounds: latencies and
    dependencies add stalls. -> {"weights_tb_s", "mma_tflop_s"} over `sms` SMs at `clock_ghz`."""
    clocks = num_warps * instructions / SCHEDULERS
    per_s = sms * clock_ghz * 1e9 / clocks
    return {"weights_tb_s": weight_bytes * per_s / 1e12, "mma_tflop_s": mma_flops * per_s / 1e12}


# an sm_90 SM (H100, H200): registers, shared memory in bytes, resident warps; registers go to a
# warp in units of 256 (8 a thread), and each resident program also reserves 1 KB of shared memory
SM90_REGISTERS, SM90_SHARED, SM90_WARPS, SM90_RESERVED = 65536, 233472, 64, 1024
# the one-token decode's (token, expert) pairs: a gather launch runs pairs x column blocks programs
TOP_K = 6


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int) -> dict:
    """The programs of `num_warps` warps, `registers` a thread and `shared_bytes` of dynamic shared
    memory that one sm_90 SM holds at once, as each resource allows ("registers", "shared",
    "warps") and all together ("programs")."""
    per_warp = -(-registers // 8) * 8 * 32
    limits = {"registers": SM90_REGISTERS // per_warp // num_warps,
              "shared": SM90_SHARED // (shared_bytes + SM90_RESERVED), "warps": SM90_WARPS // num_warps}
    return limits | {"programs": min(limits.values())}


def site_row(site: str, variant: dict, fuse_accumulate: bool = False) -> dict:
    n, k, g, rows = SITES[site]
    rows = variant.get("rows", rows)  # a variant may set the tile's rows (e.g. 128 at prefill)
    ir, kw = expert_ir(n, k, g, rows, **{key: v for key, v in variant.items() if key != "rows"})
    if fuse_accumulate:
        ir, fused = fuse_dot_add(ir)
        if not fused:
            raise RuntimeError(f"{site}: no dot followed by an add of its result in the IR")
    sass, usage, shared = compile_sass(ir, kw["num_warps"], kw["num_stages"])
    st = loop_stats(sass)
    ops = st["ops"]
    bn, bk = kw["block_n"], kw["block_k"]
    # a thread's codes per K step: a warp's instruction works for its 32 threads, and the warps
    # of a program share the step's g x block_n x block_k codes
    codes = g * bn * bk / (kw["num_warps"] * 32)
    regs, stack = _resources(usage)
    bound = issue_bound(st["instructions"], kw["num_warps"], g * bn * (bk // 2 + bk // 32), g * 2 * rows * bn * bk)
    resident = programs_per_sm(regs, kw["num_warps"], shared) if regs else None
    # a one-token gather launch (16-row tiles, one pair each): its programs over the SMs' slots
    one_token = TOP_K * (n // bn) * kw.get("k_splits", 1) if rows == 16 else None
    waves = one_token / (H200_SMS * resident["programs"]) if one_token and resident else None
    return {"site": site, "variant": variant, "fuse_accumulate": fuse_accumulate, "kernel": kw,
            "loop_instructions": st["instructions"], "codes_per_thread": codes, "issue_bound": bound,
            "instructions_per_code": st["instructions"] / codes,
            "alu_per_code": _count(ops, *ALU_OPS) / codes,
            "moves_per_code": _count(ops, "MOV", "IMAD.MOV") / codes,
            "mma": _mma(ops),
            "sts": _count(ops, "STS"), "lds": _count(ops, "LDS"), "spill_ops": _count(ops, "STL", "LDL"),
            "registers": regs, "stack_bytes": stack, "shared_bytes": shared, "programs_per_sm": resident, "one_token_programs": one_token,
            "one_token_waves": waves, "top_ops": dict(list(ops.items())[:12])}


def attention_f64_row(rows: int, **overrides) -> dict:
    """The sparse attention's float64 program (`sparse_attention.BlockSizes.f64_kernel`) at the
    released shape (64 heads x 512, 640 listed slots) for `rows` query rows, at its default tiles
    with `overrides`: the K loop's f64 multiplies (DFMA, DMUL) a thread issues against the
    products its tile needs (a step's logits and p.V products shared out over the threads; more
    means threads repeat work), its f64 tensor-core MMAs (DMMA) and its spills."""
    import functools

    from pallas_kernels.sparse_attention import api, kernel_gpu

    h, d, k = 64, 512, 640
    bs = dataclasses.replace(api.BlockSizes(f64_kernel=True).resolved("gpu", rows, d, k, h, f64=True), **overrides)
    kw = {"block_k": bs.block_k, "block_d": bs.block_d, "block_h": bs.block_h, "num_splits": bs.num_splits,
          "num_warps": bs.num_warps, "num_stages": bs.num_stages}
    f = functools.partial(kernel_gpu.sparse_attn, scale=d ** -0.5, split_probs=True, interpret=False, f64=True, **kw)
    irs = triton_ir(f, jnp.zeros((rows, 1, h, d), jnp.bfloat16), jnp.zeros((rows, 4096, d), jnp.bfloat16),
                    jnp.zeros((h,), jnp.float32), jnp.zeros((rows, 1, k), jnp.int32))
    sass, usage, _ = compile_sass(irs[0], bs.num_warps, bs.num_stages)
    st, looped = loop_or_kernel_ops(sass)  # one step a split: the whole kernel
    ops = st["ops"]
    needed = (bs.block_h * bs.block_k * d + bs.block_h * bs.block_k * bs.block_d) / 32 / bs.num_warps
    regs, stack = _resources(usage)
    return {"rows": rows, "kernel": kw, "loop": looped, "f64_mul_per_thread": _count(ops, "DFMA", "DMUL"),
            "f64_mul_needed_per_thread": needed, "dmma": _count(ops, "DMMA"),
            "spill_ops": _count(ops, "STL", "LDL"), "registers": regs, "stack_bytes": stack}


# the dense fp8 kernel's released projections for --fp8: name -> (N, K) (benchmarks.fp8_linear.SHAPES)
FP8_SITES = {"wq_b": (32768, 1280), "wo_b": (5120, 8192), "shared w1": (2304, 5120), "shared w2": (5120, 2304)}


def fp8_row(site: str, rows: int, **overrides) -> dict:
    """The dense fp8 kernel (`pallas_kernels.fp8_matmul`) for one released projection (`FP8_SITES`)
    at `rows` rows, at `api.BlockSizes`' tiles for that shape with `overrides` (BlockSizes
    fields, e.g. {"swap_ab": true}): the K loop's instructions a warp, its mix (MMA, STS: stores
    to shared memory, i.e. a decoded weight tile on its way to the MMA; LDS / LDSM: loads from
    it), per weight element a thread's share, registers, spills and shared memory. A launch
    whose programs take one K step each (K splits) has no loop: the whole kernel is counted
    ("loop": false)."""
    from pallas_kernels.fp8_matmul import api, kernel_gpu

    n, k = FP8_SITES[site]
    kw = dataclasses.replace(api.BlockSizes(), **overrides).resolved(rows, n, k).kernel_args()
    x = jnp.zeros((rows, k), jnp.bfloat16)
    w = jnp.zeros((n, k), jnp.float8_e4m3fn)
    s = jnp.zeros((n // 32, k // 32), jnp.uint8)
    irs = triton_ir(lambda x: kernel_gpu.fp8_matmul_many(x, (w,), (s,), interpret=False, **kw), x)
    sass, usage, shared = compile_sass(irs[0], kw["num_warps"], kw["num_stages"])
    st, looped = loop_or_kernel_ops(sass)  # one K step a program (K splits): the whole kernel
    ops = st["ops"]
    regs, stack = _resources(usage)
    per_elem = kw["block_n"] * kw["block_k"] / (32 * kw["num_warps"])  # a thread's share of a step's weights
    return {"site": site, "rows": rows, "kernel": kw, "loop": looped, "loop_instructions": st["instructions"],
            "instructions_per_weight": st["instructions"] / per_elem, "mma": _mma(ops),
            "sts": _count(ops, "STS"), "lds": _count(ops, "LDS"), "spill_ops": _count(ops, "STL", "LDL"),
            "registers": regs, "stack_bytes": stack, "shared_bytes": shared}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.triton_sass", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="[{}]", help="JSON list of kernel keyword overrides ({} = the defaults)")
    p.add_argument("--sites", default=",".join(SITES), help=f"comma-separated, of: {', '.join(SITES)}")
    p.add_argument("--fuse-accumulate", action="store_true",
                   help="also compile each variant with the accumulator moved into its dots (fuse_dot_add)")
    p.add_argument("--ptx", default=None, help="instead: a PTX module (a device's dump) whose kernels to count")
    p.add_argument("--function", default="expert_matmul", help="with --ptx: a regex the kernels' names match")
    p.add_argument("--attention-f64", default=None,
                   help='instead: the float64 attention program, a JSON list of {"rows": R, tile overrides}')
    p.add_argument("--fp8", default=None,
                   help='instead: the dense fp8 kernel, a JSON list of {"site": S, "rows": R, BlockSizes overrides} '
                        f'(sites: {", ".join(FP8_SITES)})')
    p.add_argument("--json", default=None)
    ns = p.parse_args(argv)
    if ns.ptx:
        return _ptx_main(p, ns)
    if ns.attention_f64:
        return _attention_main(ns)
    if ns.fp8:
        return _fp8_main(p, ns)
    try:
        variants = json.loads(ns.variants)
        if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
            raise ValueError("expected a JSON list of objects")
    except ValueError as e:
        p.error(f"--variants: {e}")
    sites = [s.strip() for s in ns.sites.split(",") if s.strip()]
    bad = [s for s in sites if s not in SITES]
    if bad:
        p.error(f"--sites: unknown {bad}; known: {list(SITES)}")
    try:
        import triton  # noqa: F401
    except ImportError:
        p.error("the triton package is needed (pip install -e '.[sass]'); it is not a project dependency")
    rows = []
    print("| site | variant | loop instr. / warp | instr. / code | ALU / code | moves / code | MMA | STS | "
          "spill ops | regs | stack B | shared KB | programs / SM | one-token waves | "
          "issue bound: weights TB/s, MMA TFLOP/s |")
    print("|" + " --- |" * 15)
    for site in sites:
        for v, fuse in ((v, f) for v in variants for f in ((False, True) if ns.fuse_accumulate else (False,))):
            label = (json.dumps(v) if v else "default") + (", accumulator in the dots" if fuse else "")
            try:
                r = site_row(site, v, fuse)
            except NotImplementedError as e:  # a tile the kernel refuses is a row of the table
                rows.append({"site": site, "variant": v, "fuse_accumulate": fuse, "error": str(e)})
                print(f"| {site} | {label} | refused: {e} |", flush=True)
                continue
            rows.append(r)
            mma = ", ".join(f"{k} {c}" for k, c in r["mma"].items())
            print(f"| {site} | {label} | {r['loop_instructions']} | "
                  f"{r['instructions_per_code']:.2f} | {r['alu_per_code']:.2f} | {r['moves_per_code']:.2f} | {mma} | "
                  f"{r['sts']} | {r['spill_ops']} | {r['registers']} | {r['stack_bytes']} | "
                  f"{r['shared_bytes'] / 1024:.0f} | {_resident(r)} | "
                  f"{'-' if r['one_token_waves'] is None else format(r['one_token_waves'], '.2f')} | "
                  f"{r['issue_bound']['weights_tb_s']:.2f}, {r['issue_bound']['mma_tflop_s']:.0f} |", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"triton": sys.modules["triton"].__version__, "rows": rows}, indent=1))
    return 0


def _resident(r: dict) -> str:
    """"2 (registers)": a row's programs an SM and the resource that sets it."""
    res = r["programs_per_sm"]
    if res is None:
        return "-"
    return f"{res['programs']} ({', '.join(k for k in ('registers', 'shared', 'warps') if res[k] == res['programs'])})"


def _attention_main(ns) -> int:
    rows = []
    print("| rows | tiles | DFMA + DMUL / thread / step | needed | spill ops | regs | stack B |")
    print("|" + " --- |" * 7)
    for v in json.loads(ns.attention_f64):
        v = dict(v)
        try:
            r = attention_f64_row(v.pop("rows", 1), **v)
        except NotImplementedError as e:
            rows.append({"variant": v, "error": str(e)})
            print(f"| {v} | refused: {e} |", flush=True)
            continue
        rows.append(r)
        print(f"| {r['rows']} | {r['kernel']} | {r['f64_mul_per_thread']} | {r['f64_mul_needed_per_thread']:.0f} | "
              f"{r['spill_ops']} | {r['registers']} | {r['stack_bytes']} |", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"triton": sys.modules["triton"].__version__, "rows": rows}, indent=1))
    return 0


def _fp8_main(p: argparse.ArgumentParser, ns) -> int:
    try:
        variants = json.loads(ns.fp8)
        if not isinstance(variants, list) or not all(isinstance(v, dict) for v in variants):
            raise ValueError("expected a JSON list of objects")
    except ValueError as e:
        p.error(f"--fp8: {e}")
    bad = sorted({v.get("site", "wq_b") for v in variants} - set(FP8_SITES))
    if bad:
        p.error(f"--fp8: unknown sites {bad}; known: {list(FP8_SITES)}")
    rows = []
    print("| site | rows | tiles | loop instr. / warp | instr. / weight | MMA | STS | LDS | spill ops | regs | "
          "shared KB |")
    print("|" + " --- |" * 11)
    for v in variants:
        v = dict(v)
        site, n_rows = v.pop("site", "wq_b"), v.pop("rows", 64)
        try:
            r = fp8_row(site, n_rows, **v)
        except NotImplementedError as e:
            rows.append({"site": site, "rows": n_rows, "variant": v, "error": str(e)})
            print(f"| {site} | {n_rows} | {v} | refused: {e} |", flush=True)
            continue
        rows.append(r)
        mma = ", ".join(f"{k} {c}" for k, c in r["mma"].items())
        loop = r["loop_instructions"] if r["loop"] else f"{r['loop_instructions']} (no loop: whole kernel)"
        print(f"| {site} | {n_rows} | {r['kernel']} | {loop} | {r['instructions_per_weight']:.2f} | "
              f"{mma} | {r['sts']} | {r['lds']} | {r['spill_ops']} | {r['registers']} | "
              f"{r['shared_bytes'] / 1024:.0f} |", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({"triton": sys.modules["triton"].__version__, "rows": rows}, indent=1))
    return 0


def _ptx_main(p: argparse.ArgumentParser, ns) -> int:
    try:
        ptx = Path(ns.ptx).read_text()
    except OSError as e:
        p.error(f"--ptx: {e}")
    try:
        import triton  # noqa: F401
    except ImportError:
        p.error("the triton package is needed for its ptxas and cuobjdump (pip install -e '.[sass]')")
    try:
        sass, usage = sass_of_ptx(ptx)
    except (ValueError, FileNotFoundError) as e:
        p.error(f"--ptx {ns.ptx}: {e}")
    except subprocess.CalledProcessError as e:
        p.error(f"--ptx {ns.ptx}: ptxas failed: {e.stderr.strip()[:500]}")
    usages = functions(usage)
    rows = []
    print("| kernel | loop instr. / warp | MMA | STS | spill ops | resources | top ops |")
    print("|" + " --- |" * 7)
    for name, text in functions(sass).items():
        if not re.search(ns.function, name):
            continue
        try:
            st = loop_stats(text)
        except ValueError:
            continue  # no loop in this kernel
        ops = st["ops"]
        mma = ", ".join(f"{k} {c}" for k, c in _mma(ops).items())
        res = " ".join(usages.get(name, "").split()[:3])
        rows.append({"kernel": name, **st, "resources": res})
        top = ", ".join(f"{k} {c}" for k, c in list(ops.items())[:8])
        print(f"| {name[:48]} | {st['instructions']} | {mma} | {_count(ops, 'STS')} | {_count(ops, 'STL', 'LDL')} | "
              f"{res} | {top} |")
    if not rows:
        p.error(f"--ptx {ns.ptx}: no kernel with a loop matches --function {ns.function!r}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
