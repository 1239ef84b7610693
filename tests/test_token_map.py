"""The Engram compressed-token map built from a tokenizer.json (SPEC §9.1)."""

import numpy as np
import pytest

from dsv41_jax.token_map import build_compressed_token_map


def _tokenizer(tmp_path, vocab):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[0]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_tokens_that_normalise_alike_share_a_compressed_id(tmp_path):
    vocab = ["<unk>", "The", "the", "THE", "café", "cafe", " ", "\t", "  ", "ﬁ", "fi", "Ａ", "a", "x\u00a0"]
    lookup, n = build_compressed_token_map(_tokenizer(tmp_path, vocab))
    ids = dict(zip(vocab, lookup.tolist(), strict=True))
    assert ids["The"] == ids["the"] == ids["THE"] == 1  # first-seen order: <unk> is 0
    assert ids["café"] == ids["cafe"]  # accents stripped
    assert ids[" "] == ids["\t"] == ids["  "]  # whitespace runs collapse; a lone space survives strip
    assert ids[" "] != ids["<unk>"]
    assert ids["ﬁ"] == ids["fi"] and ids["Ａ"] == ids["a"]  # NFKC
    assert n == len(set(lookup.tolist())) == 7  # <unk>, the, cafe, " ", fi, a, x (NBSP -> space, stripped)
    assert lookup.dtype == np.int64 and lookup.shape == (len(vocab),)


def test_missing_tokenizer_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer file not found: .*nope.json"):
        build_compressed_token_map(tmp_path / "nope.json")


def test_converter_builds_the_map_from_tokenizer_json_when_no_engram_map_ships(tmp_path):
    from convert.run import ConversionError, find_token_map
    from dsv41_jax.parity import GoldenSet

    from conftest import GOLDEN_ROOT

    args = GoldenSet(GOLDEN_ROOT / "tiny-a").args  # vocab 512, 281 compressed ids
    words = [f"w{i}" for i in range(args.engram_compressed_vocab_size)]
    vocab = words + [w.upper() for w in words[: args.vocab_size - len(words)]]
    _tokenizer(tmp_path, vocab)
    lookup = find_token_map(tmp_path, args)
    assert lookup.shape == (512,) and len(set(lookup.tolist())) == 281
    assert lookup[281] == lookup[0]  # "W0" -> "w0"
    _tokenizer(tmp_path, vocab[:-1] + ["extra"])  # 282 distinct keys: does not match the config
    with pytest.raises(ConversionError, match="has 282 ids but the config's engram_compressed_vocab_size is 281"):
        find_token_map(tmp_path, args)
