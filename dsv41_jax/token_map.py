"""The Engram compressed-token map, built from the released `tokenizer.json` (SPEC §9.1).

Every token id is decoded alone by the raw tokenizer (special tokens kept). A decoded text that
contains U+FFFD (a partial UTF-8 byte) is keyed by the raw token string; any other text by its
normal form: NFKC, NFD, strip accents, lowercase, runs of space/tab/CR/LF -> one space, a text
that is exactly one space protected by a private-use sentinel, strip, sentinel back to a space
(an empty result falls back to the un-normalised text). Distinct keys get consecutive ids in
first-seen order. The result depends only on tokenizer.json, so it is built once (by the
converter) and shipped as `engram_map.npy`.
"""

from __future__ import annotations

import os

import numpy as np

_SENTINEL = "\ue000"


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def build_compressed_token_map(tokenizer_json: str | os.PathLike) -> tuple[np.ndarray, int]:
    """tokenizer.json -> (int64 [n_tokens] raw id -> compressed id, number of compressed ids)."""
    from tokenizers import Tokenizer

    path = os.fspath(tokenizer_json)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    tok = Tokenizer.from_file(path)
    norm = _normalizer()
    n = tok.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    out = np.zeros(n, np.int64)
    for token_id in range(n):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(token_id)
        else:
            key = norm.normalize_str(text) or text
        out[token_id] = keys.setdefault(key, len(keys))
    return out, len(keys)
