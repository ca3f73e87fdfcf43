"""The shipped demo models load with mlx_lm and produce their recorded greedy tokens.

The expectations were recorded on CPU (mlx 0.32.4, mlx-lm 0.32.2) with the shipped
float16 weights (the drafter is shipped 8-bit since 2026-12-01: the same tokens; the hybrid
drafter 8-bit since 2026-12-02); a broken
export (wrong weight names, layout, norm offsets, config keys or tokenizer) changes them.
"""

import json
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from mlx_treespec.demo import NAMES, demo_path  # noqa: E402

PROMPT = "def parse("
N_TOKENS = 20

# First 20 greedy token ids after PROMPT (temp 0), per shipped model.
EXPECTED = {
    # 'string: str, value: str) -> str:\n    """Parse a string string.\n\n   '
    "target": [1764, 26, 566, 12, 563, 26, 566, 9, 519, 566, 281, 259, 436, 48, 828, 276,
               1536, 1536, 448, 259],
    # 'string):\n    return parsed(string, parsed, parsed, parsed, parsed'
    "drafter": [1764, 326, 259, 356, 2513, 68, 8, 1764, 12, 2513, 68, 12, 2513, 68, 12, 2513,
                68, 12, 2513, 68],
    # 'code, name, name, name, name, name, name, name, name, name,'
    "hybrid": [1086, 12, 657, 12, 657, 12, 657, 12, 657, 12, 657, 12, 657, 12, 657, 12, 657,
               12, 657, 12],
    # 'def parse(def parse(def parse(...': a 2-layer model alone, trained on the hybrid's own
    # continuations, not on prompts like this one (shipped 8-bit, 2026-12-02)
    "hybrid_drafter": [323, 2513, 8] * 6 + [323, 2513],
}

TOKENIZER_PROBES = [
    "def parse(text):\n    return [x.strip() for x in text.split(',')]\n",
    "class Stack:\n\tdef __init__(self, items=None):\n\t\tself._items = list(items or [])\n",
    "    # naïve café: 1_000 + 0x1F == 'ok'\r\n\n\n        pass\n",
    "<|endoftext|>import os",
]


@pytest.fixture(scope="module")
def loaded():
    return {name: mlx_lm.load(demo_path(name)) for name in NAMES}


def greedy_ids(model, tokenizer, prompt, n):
    out = []
    for resp in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n):
        out.append(resp.token)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens(loaded, name):
    model, tokenizer = loaded[name]
    ids = greedy_ids(model, tokenizer, PROMPT, N_TOKENS)
    assert len(ids) == N_TOKENS
    assert ids == EXPECTED[name], (name, ids, tokenizer.decode(ids))


@pytest.mark.parametrize("name", NAMES)
def test_config_and_files(name):
    path = Path(demo_path(name))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == ("qwen3_5" if name.startswith("hybrid") else "qwen3")
    assert cfg["vocab_size"] == 4096 and cfg["tie_word_embeddings"] is True
    log = json.loads((path / "train_log.json").read_text())
    if name == "hybrid_drafter":  # bench/train_heads.py's record: agreement with the hybrid's greedy tokens
        assert log["heldout"]["top1_generated"] > 0.5 and log["sequences_seen"] > 0
    else:
        assert log["heldout_ppl"] > 1.0 and log["tokens_seen"] > 0
    for f in path.glob("*.safetensors"):
        assert f.stat().st_size <= 15 * 1024 * 1024, f  # sharded below 15 MiB


def test_tokenizers_identical(loaded):
    files = {n: (Path(demo_path(n)) / "tokenizer.json").read_bytes() for n in NAMES}
    assert len(set(files.values())) == 1
    # transformers may pick a different tokenizer class per model_type (it forces
    # Qwen3_5Tokenizer for qwen3_5 folders): the encodings must still agree.
    for text in TOKENIZER_PROBES:
        encs = {n: loaded[n][1].encode(text) for n in NAMES}
        assert len({tuple(e) for e in encs.values()}) == 1, (text, encs)
    tok = loaded["target"][1]
    assert tok.eos_token_id == 0 and tok.vocab_size == 4096


def test_target_beats_drafter():
    ppl = {n: json.loads((Path(demo_path(n)) / "train_log.json").read_text())["heldout_ppl"]
           for n in ("target", "drafter")}
    assert ppl["target"] < 0.8 * ppl["drafter"]
