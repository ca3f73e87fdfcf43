"""A head's draft vocabulary: which token ids it drafts when narrowed (`--draft-vocab N`).

A head folder may carry `token_ranks.json`: every token id of the target's vocabulary, most
frequent first (counted over text like the text to be generated). `--draft-vocab N` drafts over
its first N. A folder without one drafts over ids 0..N-1: a byte-level BPE tokenizer numbers its
merges in the order it learned them, most frequent first, after its 256 byte tokens; counted
over other text than the tokenizer's own, that order is only an estimate (bench/RESULTS.md,
"Draft vocabularies", measures both on the demo pairs).

    python -m mlx_treespec.vocab --model PATH --text FILE_OR_FOLDER [...] [--out PATH]

counts the tokens of the text with the model folder's tokenizer and writes the ranking
(default: `PATH/token_ranks.json`). An EAGLE-3 head reads it from its own folder, which has no
tokenizer: pass the target as `--model` and `--out HEAD_FOLDER/token_ranks.json`.
"""
import argparse
import json
import os
import sys

import numpy as np

__all__ = ["RANKS_FILE", "read_ranks", "count_ranks", "main"]

RANKS_FILE = "token_ranks.json"


def read_ranks(folder, vocab_size):
    """The folder's token ranking (int32 [V], a permutation of 0..V-1), or None if it has none;
    ValueError naming the fix if it is not one."""
    path = os.path.join(str(folder), RANKS_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            ranks = np.asarray(json.load(f)["ranks"], dtype=np.int64)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a token ranking ({e}): remake it with python -m mlx_treespec.vocab") from None
    if ranks.shape != (vocab_size,) or not np.array_equal(np.sort(ranks), np.arange(vocab_size)):
        raise ValueError(f"{path} does not rank each of the target's {vocab_size} token ids once: remake it "
                         "with python -m mlx_treespec.vocab for this model's tokenizer")
    return ranks.astype(np.int32)


def count_ranks(token_ids, vocab_size):
    """Every id of 0..vocab_size-1, most frequent in `token_ids` first (ties, and ids never seen,
    in id order: the merge order of a byte-level BPE)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids outside 0..{vocab_size - 1}: the text was tokenized for another vocabulary")
    counts = np.bincount(ids, minlength=vocab_size)
    return np.lexsort((np.arange(vocab_size), -counts)).astype(np.int32)


def _texts(paths):
    for p in paths:
        files = [p] if os.path.isfile(p) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs) if os.path.isdir(p) else None
        if files is None:
            raise ValueError(f"--text {p}: no such file or folder")
        for f in files:
            try:
                with open(f, encoding="utf-8") as fh:
                    yield fh.read()
            except (UnicodeDecodeError, OSError):
                continue  # (binary files in a folder)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mlx_treespec.vocab",
                                description="Rank a model's token ids by their count in some text "
                                            "(a head's draft vocabulary, --draft-vocab).")
    p.add_argument("--model", required=True, help="the model folder (its tokenizer, and where the ranking goes)")
    p.add_argument("--text", nargs="+", required=True, help="text files or folders to count over")
    p.add_argument("--out", default=None, help=f"the ranking's path (default: MODEL/{RANKS_FILE})")
    args = p.parse_args(argv)
    try:
        from transformers import AutoTokenizer

        from .cli import resolve_model_path

        folder = resolve_model_path(args.model)
        if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"{folder} has no tokenizer: pass the target's folder as --model (for an EAGLE-3 "
                             "head, with --out HEAD_FOLDER/token_ranks.json)")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        vocab = (cfg.get("text_config") or {}).get("vocab_size", cfg.get("vocab_size"))
        if vocab is None:
            raise ValueError(f"{folder}/config.json names no vocab_size (nor text_config.vocab_size): pass "
                             "the target's own folder as --model")
        vocab = int(vocab)
        ids, n = [], 0
        for text in _texts(args.text):
            ids.append(np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64))
            n += 1
        if not n:
            raise ValueError("--text: no readable UTF-8 text found")
        ranks = count_ranks(np.concatenate(ids), vocab)
    except (ValueError, OSError) as e:  # (OSError: no tokenizer in the folder)
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = args.out or os.path.join(folder, RANKS_FILE)
    total = int(sum(a.size for a in ids))
    with open(out, "w") as f:
        json.dump(dict(about=f"token ids of {os.path.basename(os.path.normpath(folder))}'s tokenizer, most "
                             f"frequent first, counted over {total} tokens of {n} texts (python -m mlx_treespec.vocab)",
                       ranks=ranks.tolist()), f, separators=(",", ":"))
    print(f"wrote {out}: {vocab} ids ranked over {total} tokens of {n} texts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
