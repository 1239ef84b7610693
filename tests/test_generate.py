"""generate(): compiled once, cache donated, buckets, sampling, eos, batches, and the CLI."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from conftest import GOLDEN_ROOT
from dsv41_jax import generate as G
from dsv41_jax.parity import GoldenSet, load_model
from dsv41_jax.sampling import SamplingParams

TINY = GOLDEN_ROOT / "tiny-a"


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
    gen = _generator()
    prompts = [_prompt(11, 4), _prompt(30, 5)]
    batch = gen.generate(prompts, 5, return_logits=True)
    for i, p in enumerate(prompts):
        alone = gen.generate([p], 5, return_logits=True)
        assert batch.completions()[i] == alone.completions()[0]
        np.testing.assert_allclose(batch.logits[:, i], alone.logits[:, 0], rtol=0, atol=2e-2)


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


def test_bad_prompts_are_rejected_with_the_reason():
    gen = _generator()
    with pytest.raises(ValueError, match="does not fit max_seq_len=128"):
        gen.generate([_prompt(200)], 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.generate([[1, 2, 100000]], 2)


def test_cli_writes_tokens_and_logits(tmp_path, capsys):
    out = tmp_path / "r.npz"
    rc = G.main(["--ckpt", str(TINY), "--prompt-ids", "[[5, 6, 7], [8, 9]]", "--max-new-tokens", "4",
                 "--max-seq-len", "64", "--logits-out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "prefill:" in text and "decode:" in text
    r = np.load(out)
    assert r["tokens"].shape == (2, 4) and r["logits"].shape == (4, 2, 512) and r["logits"].dtype == np.float32


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "[[1, 2]]", "--max-seq-len", "2"], "does not fit max_seq_len=2"),
    (["--prompt-ids", "[[1, 512]]"], "outside the vocabulary"),
    (["--prompt", "hi"], "--prompt needs --tokenizer"),
    (["--prompt", "hi", "--tokenizer", "/nonexistent/tokenizer.json"], "file not found"),
    (["--prompt-ids", "[1, 2]"], "list of lists"),
])
def test_cli_errors_name_the_problem(argv, message, capsys):
    assert G.main(["--ckpt", str(TINY), *argv]) == 2
    assert message in capsys.readouterr().err


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
