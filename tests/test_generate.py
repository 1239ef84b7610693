"""generate(): compiled once, cache donated, buckets, sampling, eos, batches, the CLI, and the
same run on an 8-device mesh over two processes (subprocesses with fake CPU devices), bad meshes,
multi-host detection."""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import json
import os
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import GOLDEN_ROOT
from dsv41_jax import generate as G
from dsv41_jax import sharding as shd
from dsv41_jax.cache import init_cache
from dsv41_jax.parity import GoldenSet, load_model
from dsv41_jax.sampling import SamplingParams

TINY = GOLDEN_ROOT / "tiny-a"
REPO = Path(__file__).resolve().parents[1]
# three ragged rows: on a data=2 mesh the batch is padded to four
CLI_PROMPTS = "[[5, 6, 7], [8, 9], [10, 11, 12, 13]]"
CLI_ARGS = ["--prompt-ids", CLI_PROMPTS, "--max-new-tokens", "4", "--max-seq-len", "64"]


@functools.lru_cache(maxsize=None)
def _generator(max_seq_len: int = 128) -> G.Generator:
    model = load_model(GoldenSet(TINY))
    return G.Generator(model, max_seq_len=max_seq_len)


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def test_prompt_buckets_are_powers_of_two_capped_at_max_seq_len():
    assert [G.prompt_bucket(n, 100) for n in (1, 16, 17, 33, 64, 65, 99)] == [16, 16, 32, 64, 64, 100, 100]


def test_decode_compiles_once_and_a_prompt_length_in_the_same_bucket_reuses_prefill():
    gen = _generator()
    before = dict(gen.traces)
    gen.generate([_prompt(20)], 6)
    gen.generate([_prompt(25, 1)], 6)  # same bucket (32): no new prefill program, same decode program
    assert gen.traces["prefill"] - before["prefill"] <= 1
    assert gen.traces["decode"] - before["decode"] <= 1


def test_greedy_tokens_are_the_argmax_of_each_steps_logits():
    gen = _generator()
    out = gen.generate([_prompt(21, 3)], 5, return_logits=True)
    assert out.logits.shape == (5, 1, 512)
    assert out.completions()[0] == out.logits[:, 0].argmax(-1).tolist()


def test_each_row_of_a_ragged_batch_equals_running_it_alone():
    """A row of a ragged batch makes the tokens it makes alone, and its logits do not depend on
    the other row: with the other prompt replaced by another of the same length (the same
    program, the same padding) they are bit-identical. The logits against the row run alone (batch
    1, maybe another prompt bucket) are not compared: XLA:CPU's dots may add in another order at
    another matrix size (measured on an AMD EPYC host: block 1's Engram output 2e-3 apart at batch
    1 and 2, block 0 bit-identical), which the tiny random model amplifies (SPEC §20) to 0.51 in
    the 30-token row's logits (1e-6 in the 11-token row's)."""
    gen = _generator()
    prompts = [_prompt(11, 4), _prompt(30, 5)]
    batch = gen.generate(prompts, 5, return_logits=True)
    for i, p in enumerate(prompts):
        alone = gen.generate([p], 5, return_logits=True)
        assert batch.completions()[i] == alone.completions()[0]
        other = list(prompts)
        other[1 - i] = _prompt(len(prompts[1 - i]), 9 + i)
        swapped = gen.generate(other, 5, return_logits=True)
        assert swapped.completions()[1 - i] != batch.completions()[1 - i]  # the other row did change
        np.testing.assert_array_equal(swapped.logits[:, i], batch.logits[:, i])


def test_sampling_is_reproducible_for_a_key_and_varies_across_keys():
    gen = _generator()
    p = SamplingParams(temperature=1.0, top_k=50)
    a = gen.generate([_prompt(12, 6)], 8, p, key=jax.random.key(1)).completions()
    b = gen.generate([_prompt(12, 6)], 8, p, key=jax.random.key(1)).completions()
    c = gen.generate([_prompt(12, 6)], 8, p, key=jax.random.key(2)).completions()
    assert a == b and a != c


def test_generation_stops_at_any_eos_id():
    gen = _generator()
    prompt = _prompt(9, 7)
    free = gen.generate([prompt], 6).completions()[0]
    stopped = gen.generate([prompt], 6, eos_ids=(999999, free[2])).completions()[0]
    assert stopped == free[: free.index(free[2]) + 1]


@pytest.mark.parametrize("mesh", [None, "expert=1,data=1"])
def test_a_dropped_generator_frees_its_arrays_without_a_cyclic_collection(mesh):
    """The Generator's programs (single device and mesh alike; compiled and run on one device)
    hold it weakly, so dropping its last reference frees it, and the device arrays only it holds
    (on a mesh of several devices its placed copy of the model), at once, not at Python's next
    cyclic collection; its programs then refuse to run."""
    model = load_model(GoldenSet(TINY))
    gc.collect()
    gc.disable()
    try:
        gen = G.Generator(model, max_seq_len=128, mesh=None if mesh is None else shd.make_mesh(mesh))
        if mesh is None:
            want = _generator().generate([_prompt(9)], 3).completions()
            assert gen.generate([_prompt(9)], 3).completions() == want
        owner, decode = weakref.ref(gen), gen._decode
        del gen
        assert owner() is None
    finally:
        gc.enable()
    with pytest.raises(ReferenceError, match="_decode_impl: its Generator was dropped"):
        decode(*([None] * 13))


def test_bad_prompts_are_rejected_with_the_reason():
    gen = _generator()
    with pytest.raises(ValueError, match="does not fit max_seq_len=128"):
        gen.generate([_prompt(200)], 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[1, 2, 100000]], 2)


@pytest.fixture(scope="module")
def single_device_cli(tmp_path_factory) -> tuple[int, str, Path]:
    """(exit code, stdout, --logits-out file) of the CLI on the hub-format tiny-a, one device."""
    out = tmp_path_factory.mktemp("cli") / "r.npz"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = G.main(["--ckpt", str(TINY), *CLI_ARGS, "--logits-out", str(out)])
    return rc, buf.getvalue(), out


def test_cli_writes_tokens_and_logits(single_device_cli):
    rc, text, out = single_device_cli
    assert rc == 0 and "prefill:" in text and "decode:" in text
    assert "mesh: data=1,expert=1,tensor=1 over 1 cpu devices, 1 process(es)" in text
    r = np.load(out)
    assert r["tokens"].shape == (3, 4) and r["logits"].shape == (4, 3, 512) and r["logits"].dtype == np.float32


_HOST_CHILD = """
import contextlib, io, json, sys
import jax
from dsv41_jax import generate as G, sharding as shd
from dsv41_jax.checkpoint_io import load_converted
conv, work, pid, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
cli_args = json.loads(sys.argv[5])
report = {}
out = io.StringIO()
with contextlib.redirect_stdout(out):
    report["rc"] = G.main(["--ckpt", conv, "--mesh", "expert=4,data=2", "--coordinator", "localhost:" + port,
                           "--num-processes", "2", "--process-id", str(pid), *cli_args,
                           "--logits-out", f"{work}/mesh{pid}.npz"])
report["stdout"] = out.getvalue()
report["devices"] = [jax.process_count(), jax.device_count(), jax.local_device_count()]
mesh = shd.make_mesh("expert=4,data=2")
model, args = load_converted(conv, mesh, max_seq_len=64, max_batch_size=4)
gen = G.Generator(model, max_seq_len=64, mesh=mesh, pad_batch=False)
try:
    gen.generate([[5], [6], [7]], 1)
except shd.ShardingError as e:
    report["batch_error"] = str(e)
cache = gen._init_cache(4)  # born sharded: each device holds 2 of the 4 rows
kv = cache["layers"][2]["compress_kv"]
w1 = gen.state["layers"][3]["ffn"]["experts"]["w1"]["weight"][...]
report["cache"] = [list(kv.sharding.spec), [s.data.shape[0] for s in kv.addressable_shards]]
report["experts"] = [list(w1.sharding.spec), w1.addressable_shards[0].data.shape[0]]
print("REPORT " + json.dumps(report))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def test_two_hosts_on_an_expert4_data2_mesh_equal_the_single_device_run(tmp_path, single_device_cli):
    """A converted tiny-a over 2 processes x 4 fake CPU devices (one 8-device mesh, gloo
    collectives, jax.distributed via --coordinator): the same tokens and logits as one device
    from the hub files; the batch of 3 is padded to 4 for data=2; only process 0 prints and
    writes --logits-out.

    The logits are the head's f32 GEMM of the same bf16 hidden states, whose summation order
    XLA:CPU may pick by the rows each device holds (2 here, 3 on one device): on some CPUs they
    are bit-identical (max |diff| 0), on an AVX-512 Xeon up to 6.2e-7 of the row's RMS apart,
    and bit-identical there too with the head summed in float64 (so nothing before the head
    differs). The bound is the f32 summation bound's scale, dim * 2^-24 of the row's RMS."""
    from convert import convert_checkpoint

    conv = tmp_path / "converted"
    convert_checkpoint(TINY, conv, progress=False)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _HOST_CHILD, str(conv), str(tmp_path), str(i), port,
                               json.dumps(CLI_ARGS)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    reports = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, stderr[-3000:]
            reports.append(json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("REPORT "))[7:]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for r in reports:
        assert r["rc"] == 0 and r["devices"] == [2, 8, 4]
        assert r["cache"] == [["data", None, None], [2] * 4]
        assert r["experts"] == [["expert", None, None], 2]  # 8 experts over expert=4
        assert "a batch of 3 rows is not a multiple of the mesh's data axis (2)" in r["batch_error"]
    assert "mesh: data=2,expert=4,tensor=1 over 8 cpu devices, 2 process(es)" in reports[0]["stdout"]
    assert reports[1]["stdout"] == "" and not (tmp_path / "mesh1.npz").exists()
    one, many = np.load(single_device_cli[2]), np.load(tmp_path / "mesh0.npz")
    np.testing.assert_array_equal(many["tokens"], one["tokens"])
    rms = np.sqrt(np.mean(one["logits"].astype(np.float64) ** 2, axis=-1, keepdims=True))
    dim = json.loads((TINY / "config.json").read_text())["dim"]
    assert np.all(np.abs(many["logits"].astype(np.float64) - one["logits"]) <= dim * 2.0**-24 * rms)


@pytest.mark.parametrize("env, found", [
    ({}, None),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "JAX_COORDINATOR_ADDRESS"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
      "SLURM_NTASKS": "2"}, "SLURM"),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
      "SLURM_NTASKS": "1"}, None),  # a single-task SLURM job is one process
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "4"}, "Open MPI"),
    ({"TPU_WORKER_HOSTNAMES": "t0,t1"}, "GKE TPU"),
    ({"TPU_WORKER_HOSTNAMES": "t0"}, None),
])
def test_multi_host_runs_are_detected_from_the_environment(env, found):
    assert G.distributed_environment(env) == found


def test_distributed_initialisation_is_skipped_without_a_coordinator_and_modes_are_checked():
    assert G.init_distributed("auto", env={}) is False
    assert G.init_distributed("off", env={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}) is False
    with pytest.raises(ValueError, match="--distributed 'maybe': expected auto, on or off"):
        G.init_distributed("maybe")


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "[[1, 2]]", "--max-seq-len", "2"], "does not fit max_seq_len=2"),
    (["--prompt-ids", "[[1, 512]]"], "outside the vocabulary"),
    (["--prompt", "hi"], "--prompt needs --tokenizer"),
    (["--prompt", "hi", "--tokenizer", "/nonexistent/tokenizer.json"], "file not found"),
    (["--prompt-ids", "[1, 2]"], "list of lists"),
    (["--prompt-ids", "[[1]]", "--mesh", "expert=3,data=2"],
     "expert axis (3) must divide the number of routed experts (8)"),
    (["--prompt-ids", "[[1]]", "--mesh", "expert=8,data=2"], "needs 16 devices, but 1 cpu devices are available"),
    (["--prompt-ids", "[[1]]", "--mesh", "expert=2,pipeline=2"], "unknown axis 'pipeline'"),
    (["--prompt-ids", "[[1]]", "--num-processes", "2"], "--num-processes and --process-id go together"),
    (["--prompt-ids", "[[1]]", "--prefill-chunk", "0"], "--prefill-chunk must be a number of positions >= 1"),
    (["--prompt-ids", "[[1]]", "--min-context-bucket", "-1"], "--min-context-bucket must be a number of positions >= 0"),
    (["--prompt-ids", "[[1]]", "--decode-steps", "0"], "--decode-steps must be a number of steps >= 1"),
])
def test_cli_errors_name_the_problem(argv, message, capsys):
    assert G.main(["--ckpt", str(TINY), *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_passes_the_kernel_and_attention_precision_choices_to_the_model(monkeypatch, capsys):
    seen = {}

    def stub(ckpt, max_seq_len, max_batch_size, mesh=None, **overrides):
        seen.update(overrides)
        raise ValueError("stub: stop before loading")

    monkeypatch.setattr(G, "load_for_generate", stub)
    argv = ["--ckpt", str(TINY), "--prompt-ids", "[[1]]", "--kernels", "reference", "--attn-accumulate", "f32"]
    assert G.main(argv) == 2 and "stub: stop" in capsys.readouterr().err
    assert seen == {"kernels": "reference", "attn_accumulate": "f32", "fp4_scale_fold": "auto", "fp4_relaid": "auto"}
    assert G.main(argv + ["--fp4-scale-fold", "off"]) == 2 and seen["fp4_scale_fold"] == "off"
    assert G.main(argv + ["--fp4-relaid", "on"]) == 2 and seen["fp4_relaid"] == "on"
    for bad in (["--attn-accumulate", "bf16"], ["--fp4-scale-fold", "yes"], ["--fp4-relaid", "yes"]):
        with pytest.raises(SystemExit):
            G.main(["--ckpt", str(TINY), *bad])


def test_hub_loader_resolves_fp4_scale_fold_and_layout():
    """`load_for_generate` of a hub-format directory checks the routed-expert scale bytes (tiny-a's
    are all <= 128), so "auto" (the default) folds; "off" does not. It resolves the fp4 layout too:
    "off" and "auto" (the default) off the compiled GPU kernel (here the jnp path) keep the released
    words, "on" re-lays."""
    for mode, want in (("off", False), ("auto", True), (None, True)):
        model = G.load_for_generate(TINY, 32, 1, **({} if mode is None else {"fp4_scale_fold": mode}))
        assert model.args.fp4_scale_fold == ("on" if want else "off")
        assert all(layer.ffn.experts.scale_fold is want for layer in model.layers)
    for mode, want in (("off", False), (None, False), ("on", True)):
        model = G.load_for_generate(TINY, 32, 1, kernels="reference", **({} if mode is None else {"fp4_relaid": mode}))
        assert model.args.fp4_relaid == ("on" if want else "off")
        assert all(layer.ffn.experts.relaid is want for layer in model.layers)


def test_cli_rejects_a_directory_that_is_not_a_checkpoint(tmp_path, capsys):
    assert G.main(["--ckpt", str(tmp_path), "--prompt-ids", "[[1]]"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_demo_converts_loads_and_generates_and_the_cli_reads_the_converted_directory(tmp_path, capsys):
    from dsv41_jax import demo

    assert demo.main(["--new-tokens", "4", "--workdir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.startswith("4. greedy"))
    demo_tokens = line.split(": ", 1)[1]
    assert G.main(["--ckpt", str(tmp_path / "converted"), "--prompt-ids", "[[1, 17, 42, 99]]",
                   "--max-new-tokens", "4", "--max-seq-len", "32"]) == 0
    assert f"[0] {demo_tokens}" in capsys.readouterr().out


def test_context_buckets_are_powers_of_two_from_the_smallest_and_none_at_max_seq_len():
    assert [G.context_bucket(n, 512, 32) for n in (1, 32, 33, 200, 256, 257)] == [32, 32, 64, 256, 256, None]
    assert G.context_bucket(10, 512, None) is None and G.context_bucket(10, 32, 32) is None


@functools.lru_cache(maxsize=1)
def _bucketed_runs():
    """Sampled runs of a ragged batch with context buckets from 16 positions (max_seq_len 512;
    row 0 decodes positions 21..32, so both crossings, to bounds 32 and 64, fall inside the run):
    one step a call without eos ids, then five steps a call with row 0's fifth free token as an eos
    id (row 0 then stops inside a call). Returns (prompts, params, key, eos, runs, decode calls,
    decode traces), each list one entry per run; the bucket and steps-per-call tests share them."""
    model = load_model(GoldenSet(TINY))
    prompts = [_prompt(21, 4), _prompt(9, 5)]
    params, key = SamplingParams(temperature=1.0, top_k=50), jax.random.key(7)
    runs, calls, traces, eos = [], [], [], ()
    for steps in (1, 5):
        gen = G.Generator(model, max_seq_len=512, min_context_bucket=16, decode_steps=steps)
        decode, count = gen._decode, []
        gen._decode = lambda *a, _d=decode, _c=count: _c.append(1) or _d(*a)
        eos = () if steps == 1 else (runs[0].completions()[0][4],)
        runs.append(gen.generate(prompts, 13, params, key, eos_ids=eos, return_logits=True))
        calls.append(len(count))
        traces.append(gen.traces["decode"])
    return prompts, params, key, eos, runs, calls, traces


def test_decode_with_context_buckets_gives_the_same_tokens_and_logits_with_one_program_per_bucket():
    # without buckets every step's indexers score 256 (ratio 2) / 512 (ratio 1) rows; with them
    # the steps use bounds 32 and 64 (the candidate layers' widths in whole blocks)
    prompts, params, key, eos, runs, _, traces = _bucketed_runs()
    gen = G.Generator(load_model(GoldenSet(TINY)), max_seq_len=512, min_context_bucket=None, decode_steps=5)
    whole = gen.generate(prompts, 13, params, key, eos_ids=eos, return_logits=True)
    np.testing.assert_array_equal(whole.tokens, runs[1].tokens)
    np.testing.assert_array_equal(whole.logits, runs[1].logits)
    assert whole.lengths.tolist() == runs[1].lengths.tolist() == [5, 13]
    assert (traces[1], gen.traces["decode"]) == (2, 1)


def test_several_decode_steps_per_call_give_the_tokens_and_logits_of_one_step_per_call():
    # sampled, a ragged batch whose first row meets an eos id mid-call, calls cut at the end of
    # the context buckets (`_bucketed_runs`)
    _, _, _, _, (one, many), calls, traces = _bucketed_runs()
    free = one.completions()
    assert many.lengths.tolist() == [5, 13] and one.lengths.tolist() == [13, 13]  # row 0 stopped inside a call
    assert many.completions() == [free[0][:5], free[1]]
    np.testing.assert_array_equal(many.logits, one.logits)  # every step's, finished rows included
    assert len(one.step_seconds) == len(many.step_seconds) == 12
    # 12 steps from positions 21 (row 0): calls of 5, 5, 1 (bucket 32 ends), 1 (bucket 64)
    assert calls == [12, 4]
    assert traces == [2, 2]  # one program per context bucket (32, 64) whatever the steps per call


def test_a_call_stops_on_the_device_once_every_row_has_finished():
    gen = _generator()  # DECODE_STEPS (32) a call: the 7 steps after the prefill's token in one call
    assert gen.decode_steps >= 8
    prompt = _prompt(9, 7)
    free = gen.generate([prompt], 8).completions()[0]
    out = gen.generate([prompt], 8, eos_ids=(free[2],))
    assert out.completions()[0] == free[: free.index(free[2]) + 1]
    assert len(out.step_seconds) == free.index(free[2])  # steps the one call ran, not 7
    with pytest.raises(ValueError, match="decode_steps"):
        G.Generator(load_model(GoldenSet(TINY)), decode_steps=0)


def test_decode_compiles_its_loop_into_the_cuda_graph_on_gpus_unless_xla_flags_choose():
    options = G.decode_compiler_options("gpu", xla_flags="--xla_allow_excess_precision=false")
    assert options == {"xla_gpu_enable_command_buffer": G.DECODE_GPU_COMMAND_BUFFER,
                       "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    assert {"WHILE", "CONDITIONAL", "FUSION", "CUSTOM_CALL"} <= set(G.DECODE_GPU_COMMAND_BUFFER.split(","))
    # an option XLA_FLAGS sets is left to it, the other still applies
    assert G.decode_compiler_options("gpu", xla_flags="--xla_gpu_enable_command_buffer=") == {
        "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}
    assert G.decode_compiler_options("gpu", xla_flags="--xla_gpu_command_buffer_scheduling_mode=LHS") == {
        "xla_gpu_enable_command_buffer": G.DECODE_GPU_COMMAND_BUFFER}
    assert G.decode_compiler_options("gpu", xla_flags="--xla_gpu_enable_command_buffer= "
                                     "--xla_gpu_command_buffer_scheduling_mode=LHS") is None
    assert G.decode_compiler_options("cpu", xla_flags="") is None
    assert G.decode_compiler_options("tpu", xla_flags="") is None
    # this XLA knows every command and the scheduling mode named (an unknown one fails the
    # compile), and a loop's values do not depend on the options (CPU ignores them; the GPU test
    # below runs the model)
    loop = lambda x: jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * 3 + 1), (0, x))[1]
    x = np.arange(4, dtype=np.float32)
    compiled = jax.jit(loop).lower(x).compile(compiler_options=options)
    np.testing.assert_array_equal(compiled(x), jax.jit(loop)(x))
    bad = {"xla_gpu_enable_command_buffer": "WHILE,NO_SUCH_COMMAND"}
    with pytest.raises(Exception, match="not a valid enum value"):
        jax.jit(loop).lower(x).compile(compiler_options=bad)
    with pytest.raises(Exception, match="NO_SUCH_MODE"):
        jax.jit(loop).lower(x).compile(compiler_options={"xla_gpu_command_buffer_scheduling_mode": "NO_SUCH_MODE"})
    # Generator(decode_options=...) compiles the decode program with them (the bad one fails there)
    gen = G.Generator(load_model(GoldenSet(TINY)), max_seq_len=64, decode_options=bad)
    with pytest.raises(Exception, match="not a valid enum value"):
        gen.generate([_prompt(5)], 3)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_decode_loop_in_the_cuda_graph_gives_the_tokens_and_logits_of_the_host_loop():
    model = load_model(GoldenSet(TINY))
    prompts = [_prompt(21, 4), _prompt(9, 5)]
    params, key = SamplingParams(temperature=1.0, top_k=50), jax.random.key(7)
    runs = []
    for options in (None, {}):  # the default (loop in the graph, kernels concurrent), XLA's (host loop)
        gen = G.Generator(model, max_seq_len=512, min_context_bucket=16, decode_steps=5, decode_options=options)
        runs.append(gen.generate(prompts, 13, params, key, return_logits=True))
    assert runs[0].completions() == runs[1].completions()
    np.testing.assert_array_equal(runs[0].logits, runs[1].logits)


def test_the_next_decode_call_is_dispatched_before_a_calls_tokens_are_read():
    model = load_model(GoldenSet(TINY))
    gen = G.Generator(model, max_seq_len=128, decode_steps=2)
    decode, log = gen._decode, []

    class Ran:  # the steps-run output of call k: reading it is reading the call's results
        def __init__(self, value, k):
            self.value, self.k = value, k

        def __int__(self):
            log.append(("read", self.k))
            return int(self.value)

    def logged(*args):
        k = sum(event == "call" for event, _ in log)
        log.append(("call", k))
        out = decode(*args)
        return (*out[:2], Ran(out[2], k), *out[3:])

    gen._decode = logged
    prompt = _prompt(9, 7)
    out = gen.generate([prompt], 7, return_logits=True)  # the prefill's token, then 3 calls of 2 steps
    assert log == [("call", 0), ("call", 1), ("read", 0), ("call", 2), ("read", 1), ("read", 2)]
    alone = _generator().generate([prompt], 7, return_logits=True)  # the 6 steps in one call
    assert out.completions() == alone.completions() and len(out.step_seconds) == 6
    np.testing.assert_array_equal(out.logits, alone.logits)


def test_generate_equals_a_host_loop_of_single_decode_steps():
    # greedy decoding written out without Generator: prefill, then one jitted decode step per token
    model = load_model(GoldenSet(TINY))
    prompt = _prompt(13, 8)
    out = _generator().generate([prompt], 8, return_logits=True)
    ids = np.zeros((1, 16), np.int32)
    ids[0, :13] = prompt
    logits, cache = jax.jit(model.prefill)(ids, np.asarray([13], np.int32), init_cache(model.args, 1, 128))
    step = jax.jit(lambda tok, pos, cache: model.decode_step(tok, pos, cache))
    want_logits, toks = [np.asarray(logits[0])], [int(np.argmax(logits[0]))]
    for pos in range(13, 20):
        logits, cache = step(np.asarray(toks[-1:], np.int32), np.asarray([pos], np.int32), cache)
        want_logits.append(np.asarray(logits[0]))
        toks.append(int(np.argmax(logits[0])))
    assert out.completions()[0] == toks
    np.testing.assert_array_equal(out.logits[:, 0], np.stack(want_logits))
