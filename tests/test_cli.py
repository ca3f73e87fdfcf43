"""The command line: the shipped pair out of the box, and one-line errors with exit code 2."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import save_config, save_model

import tiny
from mlx_treespec import make_drafter, tree_generate_step
from mlx_treespec.generate import check_vocab

DEMO = os.path.join(os.path.dirname(__file__), "..", "mlx_treespec", "demo")


def cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "mlx_treespec.generate", *args], capture_output=True,
                          text=True, input=stdin, timeout=300)


def cli_here(*args):
    """`cli(*args)` in this process (a process spends ~3 s starting here): `main`, its exit code
    from SystemExit; the out-of-the-box tests keep a process each."""
    import contextlib
    import io
    import warnings

    from mlx_treespec.cli import main

    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")  # (each warning a process would print counts as its lines)
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    for w in warned:
        err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_demo_runs_out_of_the_box_and_prints_mlx_lm_format():
    r = cli("--prompt", "def parse(", "--max-tokens", "24", "--tree-topk", "2", "--tree-depth", "3",
            "--tree-budget", "6", "--verbose")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count("==========") == 2
    assert "Prompt:" in out and "Generation: 24 tokens" in out and "Peak memory:" in out
    assert "emitted/verify" in out and "Acceptance by depth" in out
    rounds, per = re.search(r"Rounds: (\d+), emitted/verify: ([\d.]+)", out).groups()
    assert round(int(rounds) * float(per)) == 24  # the last round, cut short at --max-tokens, counts too


def test_cli_output_equals_plain_decoding_of_the_demo_target():
    spec = cli("--prompt", "import os\n", "--max-tokens", "40", "--verbose", "F")
    plain = cli("--prompt", "import os\n", "--max-tokens", "40", "--verbose", "F", "--drafter", "none")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    assert spec.stdout == plain.stdout and len(spec.stdout.strip()) > 0


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such folder"),
    (["--tree-topk", "0"], "--tree-topk"),
    (["--tree-topk", "2", "--tree-lanes", "3"], "--tree-lanes"),
    (["--tree-topk", "2", "--tree-depth", "3", "--tree-budget", "100"], "--tree-budget"),
    (["--draft-block-size", "300"], "depth"),
    (["--draft-block-size", "70"], "a chain of at most 15 (--draft-block-size)"),
    (["--draft-block-size", "3", "--tree-topk", "2"], "not both"),
    (["--max-kv-size", "2", "--prompt", "def parse(value, other):"], "--max-kv-size"),
    (["--max-kv-size", "64", "--kv-bits", "8"], "kv_bits"),
    (["--max-tokens", "0"], "non-zero"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    r = cli_here(*args)
    assert r.returncode == 2
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert needle in lines[0]
    assert "==========" not in r.stdout  # nothing half-written


def _save_folder(tmp_path, name, model, cfg):
    path = tmp_path / name
    save_model(str(path), model)
    save_config(dict(cfg), str(path / "config.json"))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(DEMO, "target", f)):
            shutil.copy(os.path.join(DEMO, "target", f), path / f)
    return str(path)


def test_unsupported_target_lists_every_blocker(tmp_path):
    from test_support import MAMBA2, build

    with open(os.path.join(DEMO, "target", "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cfg = dict(MAMBA2, vocab_size=vocab)
    path = _save_folder(tmp_path, "mamba2", build(cfg), cfg)
    r = cli("--model", path, "--draft-model", "demo-drafter")
    assert r.returncode == 2
    assert "layer 0" in r.stderr and "layer 1" in r.stderr and "layer 2" in r.stderr
    assert "mamba2" in r.stderr


def test_a_draft_vocabulary_larger_than_the_targets_is_refused_and_a_smaller_one_is_exact(tmp_path):
    """Checkpoints of one tokenizer pad their embeddings differently: a draft of fewer rows
    proposes only ids the target embeds (exact, greedy and sampled); one of more is refused."""
    target = tiny.build(dict(tiny.CONFIGS["qwen3"], vocab_size=tiny.VOCAB + 8))
    small = tiny.build(tiny.CONFIGS["qwen3"])
    with pytest.raises(ValueError, match="larger than the target's"):
        check_vocab(small, target)
    check_vocab(target, small)
    prompt = list(range(1, 9)) * 2
    for kw in ({}, dict(temp=0.9, seed=3)):
        ref = [t for t, _, _ in tree_generate_step(prompt, target, None, max_tokens=24, **kw)]
        out = [t for t, _, _ in tree_generate_step(prompt, target, make_drafter(small, target=target,
                                                   draft_block_size=3), max_tokens=24, **kw)]
        assert out == ref
    # the CLI compares the tokenizers, as mlx-lm does (a folder of the demo's tokenizer: its rows are checked)
    cfg = dict(tiny.CONFIGS["qwen3"], vocab_size=8192)  # (the demo target embeds 4,096)
    big = _save_folder(tmp_path, "big_vocab", tiny.build(cfg), cfg)
    r = cli("--draft-model", big, "--max-tokens", "4")
    assert r.returncode == 2 and "vocabulary" in r.stderr
    # the hybrid demo target with the demo drafter shares the tokenizer: accepted
    r = cli("--model", "demo-hybrid", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr


def test_the_demo_hybrid_drafts_with_its_hybrid_draft_model():
    # with a draft-model shape, `--model demo-hybrid` drafts with the shipped qwen3_5 draft model
    # (GatedDeltaNet layers of its own, rolled back by replay): the text is plain decoding's
    args = ("--model", "demo-hybrid", "--prompt", "import os\n", "--max-tokens", "24")
    spec = cli(*args, "--drafter", "model", "--draft-block-size", "3", "--verbose")
    plain = cli(*args, "--drafter", "none", "--verbose", "F")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    assert spec.stdout.split("==========")[1].strip() == plain.stdout.strip()
    # a chain of 3 one-token steps (the last round, capped at the tokens left, drafts fewer)
    assert "depth requested 3" in spec.stdout
    rounds = int(re.search(r"Rounds: (\d+)", spec.stdout).group(1))
    forwards = float(re.search(r"draft forwards/round: ([\d.]+)", spec.stdout).group(1))
    assert 3 * (rounds - 1) < forwards * rounds <= 3 * rounds


def test_errors_leave_a_passed_cache_untouched():
    target = tiny.build(tiny.CONFIGS["qwen3"])
    draft = tiny.perturbed(target)
    cache = make_prompt_cache(target)
    target(mx.array([[1, 2, 3, 4]]), cache=cache)
    mx.eval([c.state for c in cache])
    before = [(c.offset, np.array(c.keys[..., : c.offset, :])) for c in cache]
    with pytest.raises(ValueError):
        make_drafter(draft, tree_topk=2, tree_depth=3, tree_budget=99)
    with pytest.raises(ValueError):
        list(tree_generate_step([5, 6], target, None, prompt_cache=cache, max_kv_size=8, kv_bits=8))
    with pytest.raises(ValueError):
        list(tree_generate_step([], target, None, prompt_cache=cache))
    for c, (off, keys) in zip(cache, before):
        assert c.offset == off
        assert np.array_equal(np.array(c.keys[..., : c.offset, :]), keys)


def test_default_draft_shape_is_adaptive_over_the_fixed_one_lane_tree():
    # no shape option: adaptive drafting whose model arm is a spine of 8 with each step's two
    # runners-up (DEFAULT_TREE); any one option fixes the shape (tree_topk defaults to 1: a chain)
    from mlx_treespec.adaptive import AdaptiveDrafter

    draft = tiny.build(tiny.CONFIGS["qwen3"])
    a = make_drafter(draft)
    assert isinstance(a, AdaptiveDrafter) and a.host is not None
    d = a.primary
    assert (d.topk, d.lanes, d.depth, d.budget) == (3, 1, 8, 24)
    assert d.budget >= d.depth * d.topk  # every candidate stays: the fixed layout, no re-rank
    c = make_drafter(draft, tree_depth=5)
    assert (c.topk, c.lanes, c.depth, c.budget) == (1, 1, 5, 5)
    assert make_drafter(draft, draft_block_size=3).depth == 3
    # the demo's default: its DFlash drafter, adaptive; the CLI reports what each round used
    r = cli("--prompt", "def parse(", "--max-tokens", "24", "--verbose")
    assert r.returncode == 0, r.stderr
    assert "budget requested 31" in r.stdout and "depth requested 15" in r.stdout
    assert "Rounds by drafter:" in r.stdout
    r = cli("--prompt", "def parse(", "--max-tokens", "24", "--verbose", "--tree-topk", "3", "--tree-lanes", "1",
            "--tree-depth", "8")
    assert "budget requested 24" in r.stdout and "Rounds by drafter" not in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["--max-tokens", "-5"], "-1 for no limit"),
    (["--draft-block-size", "4", "--tree-budget", "1000"], "--tree-budget"),
    (["--drafter", "dflash", "--tree-budget", "256"], "must be in 1..255"),
    (["--tree-depth", "4", "--tree-budget", "8"], "--tree-budget"),
    (["--tree-topk", "3", "--tree-depth", "0"], "--tree-depth"),
    (["--drafter", "dflash", "--tree-topk", "3"], "--tree-topk"),
    (["--drafter", "mtp"], "MTP heads are for"),  # the demo target is a qwen3: no MTP layer
    (["--drafter", "lookup", "--draft-vocab", "512"], "narrows a head's lm_head"),
    (["--model", "demo-hybrid", "--drafter", "mtp", "--draft-vocab", "4096"], "--draft-vocab (token ids a head drafts) must be in 16..4095"),
    (["--model", "nonexistent-org/nonexistent-model"], "download it first"),
])
def test_more_bad_input_is_one_line_exit_2(args, needle):
    # (a Hub name in a process of its own: huggingface_hub reads HF_HUB_OFFLINE when imported)
    if "nonexistent-org/nonexistent-model" in args:
        r = subprocess.run([sys.executable, "-m", "mlx_treespec.generate", *args], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    else:
        r = cli_here(*args)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


def test_non_utf8_prompts_are_one_line_errors():
    r = subprocess.run([sys.executable, "-m", "mlx_treespec.generate", "--prompt", "-"], input=b"def f(\xff\xfe):",
                       capture_output=True, timeout=300)
    assert r.returncode == 2 and b"not UTF-8" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "mlx_treespec.generate", "--prompt", b"def f(\xff):".decode(
        "utf-8", "surrogateescape")], capture_output=True, timeout=300)
    assert r.returncode == 2 and b"not UTF-8" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_prefill_progress_ends_its_line():
    r = subprocess.run([sys.executable, "-m", "mlx_treespec.generate", "--prompt", "def parse(value):\n    return value\n" * 8,
                        "--prefill-step-size", "16", "--max-tokens", "4"], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    assert "\rPrefill:" in err and err.endswith("\n")
    done, total = err.split("\r")[-1].split()[1].split("/")
    assert done == total  # the line ends at the whole prompt, then a newline


@pytest.mark.parametrize("model,drafter,shape", [("demo", "dflash", ()), ("demo", "eagle3", ()), ("demo-hybrid", "mtp", ()),
                                                 ("demo-hybrid", "dflash", ())])
def test_shipped_heads_run_out_of_the_box_and_equal_plain(model, drafter, shape):
    spec = cli("--model", model, "--drafter", drafter, *shape, "--prompt", "import os\n", "--max-tokens", "40",
               "--verbose")
    plain = cli("--model", model, "--drafter", "none", "--prompt", "import os\n", "--max-tokens", "40", "--verbose", "F")
    assert spec.returncode == 0 and plain.returncode == 0, spec.stderr + plain.stderr
    text = spec.stdout.split("==========")[1].strip()
    assert text == plain.stdout.strip() and text
    assert "emitted/verify" in spec.stdout
    rate = float(spec.stdout.split("emitted/verify: ")[1].split(",")[0])
    assert rate > 1.0  # the trained head's drafts are accepted


def _text(r):
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_mlx_lm_flags():
    # --num-draft-tokens is mlx-lm's name for the chain's length
    r = cli_here("--num-draft-tokens", "3", "--max-tokens", "24", "--verbose")
    assert "depth requested 3" in _text(r)
    plain = _text(cli_here("--drafter", "none", "--max-tokens", "24", "--verbose", "F")).strip()
    assert r.stdout.split("==========")[1].strip() == plain
    # --extra-eos-token ends generation at that token, as in mlx-lm
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from pathlib import Path

    tok = load_tokenizer(Path(DEMO) / "target")
    ids = tok.encode("def parse(" + plain, add_special_tokens=False)
    stop = tok.convert_ids_to_tokens(ids[len(tok.encode("def parse(", add_special_tokens=False)) + 3])
    cut = _text(cli_here("--max-tokens", "24", "--verbose", "F", "--extra-eos-token", stop)).strip()
    assert plain.startswith(cut) and len(cut) < len(plain)
    # --min-tokens-to-keep reaches the sampler; one seed gives one output
    sampled = [_text(cli_here("--max-tokens", "16", "--verbose", "F", "--temp", "0.9", "--min-p", "0.6",
                              "--min-tokens-to-keep", "3", "--seed", "5")) for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0].strip()
    # XTC, keyed by position: the speculative text is plain sampled decoding's
    xtc = ["--max-tokens", "24", "--verbose", "F", "--temp", "0.8", "--seed", "2", "--xtc-probability", "0.5"]
    assert _text(cli_here(*xtc)) == _text(cli_here(*xtc, "--drafter", "none"))


@pytest.mark.parametrize("args,needle", [
    (["--adapter-path", "/nonexistent/adapters"], "--adapter-path"),
    (["--chat-template-config", "{not json"], "--chat-template-config"),
    (["--min-tokens-to-keep", "0"], "--min-tokens-to-keep"),
    (["--xtc-threshold", "0.9", "--temp", "0.5"], "xtc_threshold"),
    (["--use-default-chat-template"], "--use-default-chat-template"),  # the demo tokenizer has none
    (["--prompt-cache-file", "/nonexistent/cache.safetensors"], "--prompt-cache-file"),
])
def test_parity_flags_bad_input_is_one_line_exit_2(args, needle):
    r = cli_here(*args, "--max-tokens", "4")
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--seed", "abc"], "--seed"),  # argparse's own errors: one line too
    (["--verbose", "maybe"], "T or F"),
    (["--save-prompt-cache", "/nonexistent/c.safetensors"], "existing folder"),
    (["--prompt-cache-file", os.path.join(DEMO, "target", "config.json")], "not a prompt cache"),
    (["--prompt-cache-file", "c.safetensors", "--max-kv-size", "8"], "drop one"),
    (["--drafter", "none", "--tree-topk", "3"], "nothing drafts"),
    (["--drafter", "dflash", "--draft-block-size", "40"], "at most 15"),
    (["--temp", "-1"], "temp"),
    (["--extra-eos-token", "99999"], "--extra-eos-token"),
    (["--drafter", "lookup", "--draft-model", "/nonexistent"], "drop --draft-model"),
    (["--drafter", "dflash", "--draft-model", "/nonexistent"], "--draft-model /nonexistent: no such folder"),
    (["--draft-model", "demo-eagle3"], "--drafter eagle3 --draft-model"),  # (mlx-lm's error ran 31 lines)
    (["--draft-model", "demo-drafter", "--draft-lookup", "4", "--draft-lookup-trust", "0"], "1..4"),
])
def test_audited_bad_input_is_one_line_exit_2(args, needle):
    r = cli_here(*args, "--max-tokens", "4")
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], r.stderr


def test_prompt_cache_files_round_trip_with_mlx_lm(tmp_path):
    # a cache made by mlx_lm.cache_prompt continues here as in mlx_lm.generate (speculating or
    # not); --save-prompt-cache writes one mlx-lm reads, holding prompt and response
    from mlx_lm.models.cache import load_prompt_cache

    target = os.path.abspath(os.path.join(DEMO, "target"))
    made = tmp_path / "mlx.safetensors"
    r = subprocess.run([sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", target, "--prompt",
                        "def parse(value):", "--prompt-cache-file", str(made)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    theirs = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", target, "--prompt-cache-file",
                             str(made), "--prompt", "    return", "--max-tokens", "24", "--verbose", "False"],
                            capture_output=True, text=True, timeout=300)
    assert theirs.returncode == 0, theirs.stderr
    ours = cli_here("--prompt-cache-file", str(made), "--prompt", "    return", "--max-tokens", "24", "--verbose", "F",
                    "--draft-model", "demo-drafter")
    assert _text(ours) == theirs.stdout
    plain = cli_here("--prompt-cache-file", str(made), "--prompt", "    return", "--max-tokens", "24")
    assert _text(plain).split("==========")[1].strip() == theirs.stdout.strip()
    assert "decoding without speculation" in plain.stderr  # a non-demo model and no drafter: said
    saved = tmp_path / "ours.safetensors"
    r = cli_here("--prompt-cache-file", str(made), "--prompt", "    return", "--max-tokens", "24", "--verbose", "F",
            "--draft-model", "demo-drafter", "--save-prompt-cache", str(saved))
    cache, meta = load_prompt_cache(str(saved), return_metadata=True)
    assert meta["model"] == target and cache[0].offset == load_prompt_cache(str(made))[0].offset + 2 + 24
    assert _text(cli_here("--prompt-cache-file", str(saved), "--prompt", "\n", "--max-tokens", "8"))


def _demo_copy(tmp_path, name, tokenizer=None, config=None, files=None):
    """The demo target's folder under another name, its tokenizer_config / config updated."""
    folder = tmp_path / name
    shutil.copytree(os.path.join(DEMO, "target"), folder)
    for file, more in (("tokenizer_config.json", tokenizer), ("config.json", config)):
        if more:
            data = json.loads((folder / file).read_text())
            (folder / file).write_text(json.dumps(dict(data, **more)))
    for file, text in (files or {}).items():
        (folder / file).write_text(text)
    return str(folder)


def test_chat_templates_remote_code_and_saved_caches_as_mlx_lm(tmp_path):
    # mlx-lm's rules, each once broken here: a template from `chat_template_type` (or a
    # tokenizer's own renderer) counts as one; an empty --system-prompt is a system message;
    # --prefill-response continues the assistant's turn; --trust-remote-code reaches the model
    # loader; a cache saved from --model demo names its folder (mlx-lm reads the file)
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    chat = _demo_copy(tmp_path, "chat", tokenizer=dict(chat_template=template))
    typed = _demo_copy(tmp_path, "typed", tokenizer=dict(chat_template_type="deepseek_v32"))
    remote = _demo_copy(tmp_path, "remote", config=dict(model_file="custom.py"),
                        files={"custom.py": "from mlx_lm.models.qwen3 import Model, ModelArgs\n"})

    def mlx_lm_text(*args):
        r = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--prompt", "def parse(", *args, "--max-tokens",
                            "12", "--verbose", "False"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    # (and a prompt longer than --max-kv-size: the rotating cache keeps its window, as mlx-lm's; refused before)
    for args in (["--model", chat, "--system-prompt", ""], ["--model", chat, "--prefill-response", "def "],
                 ["--model", typed], ["--model", remote, "--trust-remote-code"],
                 ["--model", os.path.join(DEMO, "target"), "--max-kv-size", "6"]):
        ours = cli_here(*args, "--draft-model", "demo-drafter", "--max-tokens", "12", "--verbose", "F")
        assert _text(ours) == mlx_lm_text(*args), args
    from mlx_lm.models.cache import load_prompt_cache

    saved = tmp_path / "demo.safetensors"
    assert _text(cli_here("--max-tokens", "8", "--verbose", "F", "--save-prompt-cache", str(saved)))
    assert os.path.isdir(load_prompt_cache(str(saved), return_metadata=True)[1]["model"])
    assert mlx_lm_text("--prompt-cache-file", str(saved), "--prompt", "x")
    # read back here with no --model, it is the demo again: its drafter speculates
    assert "emitted/verify" in _text(cli_here("--prompt-cache-file", str(saved), "--prompt", "x", "--max-tokens", "8",
                                         "--verbose", "T"))
    # a prefilled response over a saved conversation: the new user message goes in (the part
    # kept was cut at the prefill, as mlx-lm 0.32.2 still cuts it, and the message was lost)
    convo = tmp_path / "chat.safetensors"
    assert _text(cli_here("--model", chat, "--max-tokens", "4", "--verbose", "F", "--save-prompt-cache", str(convo)))

    def prompt_tokens(text):
        out = _text(cli_here("--prompt-cache-file", str(convo), "--prompt", text, "--prefill-response", "def ",
                        "--max-tokens", "2", "--verbose", "T", "--drafter", "none"))
        return int(out.split("Prompt: ")[1].split(" tokens")[0])

    assert prompt_tokens("import os and sys and json") > prompt_tokens("x") + 3
    for args, needle in ((["--image", "a.png"], "--image"), (["--shard", "tensor", "--save-prompt-cache",
                                                            str(saved)], "one process's slice"),
                         (["--prefill-response", "x"], "this tokenizer has none"),
                         (["--model", chat, "--ignore-chat-template", "--prefill-response", "x"], "drops it")):
        r = cli_here(*args, "--max-tokens", "4")
        lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


def test_readme_real_model_commands_run_on_stand_ins(tmp_path):
    # the README's real-model commands, each model swapped for a small stand-in of its family
    # (random weights, the demo tokenizer): they run, and speculate to plain decoding's text
    import shlex
    from pathlib import Path

    from test_dflash import dflash_config, save_random

    vocab = json.load(open(os.path.join(DEMO, "target", "config.json")))["vocab_size"]
    qwen3 = dict(tiny.CONFIGS["qwen3"], vocab_size=vocab)
    gemma3 = dict(tiny.CONFIGS["gemma3"], vocab_size=vocab)
    q_target, g_target = tiny.build(qwen3), tiny.build(gemma3)
    stand_ins = {
        "mlx-community/Qwen3-8B-4bit": _save_folder(tmp_path, "qwen3", q_target, qwen3),
        "mlx-community/Qwen3-0.6B-4bit": _save_folder(tmp_path, "qwen3_draft", tiny.perturbed(q_target), qwen3),
        "PATH/TO/Qwen3-8B-DFlash": save_random(tmp_path / "dflash", dflash_config(qwen3, block=8)),
        "PATH/TO/Qwen3.5-folder": os.path.join(DEMO, "hybrid"),
        "mlx-community/gemma-3-12b-it-4bit": _save_folder(tmp_path, "gemma3", g_target, gemma3),
        "mlx-community/gemma-3-1b-it-4bit": _save_folder(tmp_path, "gemma3_draft", tiny.perturbed(g_target), gemma3),
    }
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("<!-- real-models -->")[1].split("<!-- /real-models -->")[0]
    commands = [l for l in block.splitlines() if l.startswith("python -m mlx_treespec.generate")]
    assert len(commands) == 4
    for line in commands:
        args = shlex.split(line)[3:]
        for i, a in enumerate(args[:-1]):
            if a in ("--model", "--draft-model"):
                assert args[i + 1] in stand_ins, args[i + 1]
                args[i + 1] = stand_ins[args[i + 1]]
        out = _text(cli(*args, "--max-tokens", "24", "--verbose", "F")).strip()
        model = args[args.index("--model") + 1]
        plain = _text(cli("--model", model, "--drafter", "none", "--prompt", args[args.index("--prompt") + 1],
                          "--max-tokens", "24", "--verbose", "F")).strip()
        assert out == plain and out, line


def test_use_default_chat_template_applies_the_tokenizers_default(monkeypatch, capsys, tmp_path):
    # a tokenizer with no chat template but a default one: the flag renders the prompt with it,
    # --chat-template-config reaches the template, and --adapter-path / --trust-remote-code
    # reach mlx-lm's load
    from mlx_lm.utils import load

    from mlx_treespec import cli as cli_module

    model, tok = load(os.path.join(DEMO, "target"))
    tok._tokenizer.default_chat_template = ("{% for m in messages %}{{ greeting }}>>> {{ m['content'] }}\n"
                                            "{% endfor %}")
    seen, loads = [], []
    real_encode = tok._tokenizer.encode

    def encode(text, **kw):
        seen.append(text)
        return real_encode(text, **kw)

    tok._tokenizer.encode = encode  # this test's own tokenizer: nothing to undo
    monkeypatch.setattr(cli_module, "_load", lambda *a, **k: loads.append(a) or (model, tok))
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    cli_module.main(["--use-default-chat-template", "--chat-template-config", '{"greeting": "hi "}',
                     "--adapter-path", str(adapters), "--trust-remote-code", "--drafter", "none",
                     "--prompt", "def f(", "--max-tokens", "4", "--verbose", "F"])
    assert seen and seen[0].startswith("hi >>> def f(")
    assert capsys.readouterr().out.strip()
    _, adapter_path, tokenizer_config = loads[0]
    assert adapter_path == str(adapters) and tokenizer_config["trust_remote_code"] is True


def test_the_probe_compares_draws_when_sampling(monkeypatch):
    # on a GPU the CLI probes the verify before speculating: sampled (--temp > 0), with the run's
    # sampler settings, so it counts flipped draws, not argmaxes (on CPU it probes nothing)
    import types

    import mlx_treespec.cli as cli
    import mlx_treespec.probe as probe

    seen = []
    monkeypatch.setattr(cli, "mx", types.SimpleNamespace(default_device=lambda: "a gpu", cpu=mx.cpu))
    monkeypatch.setattr(probe, "check_speculation", lambda model, topologies, **k: seen.append((topologies, k)))
    drafter = types.SimpleNamespace(probe_parents=lambda: np.array([-1, 0, 1, 0]))
    for flags in (["--temp", "0.7", "--top-p", "0.9"], []):
        cli._probe(cli.setup_arg_parser().parse_args(["--model", "demo"] + flags), None, drafter)
    assert not seen[0][1]["sampler"].greedy and seen[1][1]["sampler"].greedy
    # a drafter whose layout follows the draw (a head's default: spec.SAMPLED_TREES) is probed
    # in the layout a sampled generation drafts too
    shaped = types.SimpleNamespace(draw=None)
    shaped.probe_parents = lambda: np.array([-1, 0, 0, 0]) if shaped.draw is not None else np.array([-1, 0, 1, 2])
    seen.clear()
    for flags in (["--temp", "0.7"], []):
        cli._probe(cli.setup_arg_parser().parse_args(["--model", "demo"] + flags), None, shaped)
        shaped.draw = None
    assert [len(t) for t, _ in seen] == [3, 2] and seen[0][0][2].tolist() == [-1, 0, 0, 0]
    # an adaptive drafter's prompt lookup verifies its own trees and chains (16 deep, where its
    # primary's were 8): probed too
    seen.clear()
    adaptive = types.SimpleNamespace(primary=object(), host=types.SimpleNamespace(
        probe_parents=lambda: np.array([-1, 0, 1, 2, 3, 0])), probe_parents=lambda: np.array([-1, 0, 1]))
    cli._probe(cli.setup_arg_parser().parse_args(["--model", "demo"]), None, adaptive)
    assert [t.tolist() for t in seen[0][0]][2:] == [[-1, 0, 1, 2, 3, 0], [-1, 0, 1, 2, 3]]


def test_broken_model_folders_are_one_line_errors(tmp_path):
    """A config without model_type (mlx-lm: a bare KeyError) and a truncated weights file
    (a RuntimeError): one line naming the fix, exit 2."""
    for name, breaks in (("no_type", "config"), ("cut", "weights")):
        folder = tmp_path / name
        shutil.copytree(os.path.join(DEMO, "target"), folder)
        if breaks == "config":
            config = json.loads((folder / "config.json").read_text())
            del config["model_type"]
            (folder / "config.json").write_text(json.dumps(config))
        else:
            weights = folder / "model-00001-of-00002.safetensors"
            weights.write_bytes(weights.read_bytes()[:1000])
        r = cli("--model", str(folder), "--prompt", "hi", "--max-tokens", "4")
        lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert ("model_type" in lines[0]) if breaks == "config" else ("again" in lines[0])


def test_num_draft_tokens_is_ignored_where_nothing_drafts():
    """mlx-lm's --num-draft-tokens without a draft model decodes plainly, there and here."""
    r = cli("--model", os.path.join(DEMO, "target"), "--prompt", "hi", "--max-tokens", "8", "--num-draft-tokens", "3")
    assert r.returncode == 0, r.stderr


def test_kv_bits_are_checked_against_a_hybrid_prompt_cache(tmp_path):
    """A hybrid's first cache is recurrent: the check reads its first quantized layer (--kv-bits 4
    over an 8-bit cache ran on with the 8-bit layers)."""
    import argparse

    from mlx_lm.models.cache import save_prompt_cache
    from mlx_treespec.cli import _read_prompt_cache

    target = tiny.build(dict(tiny.CONFIGS["qwen3_5"], head_dim=32))
    cache = make_prompt_cache(target)
    target(mx.arange(1, 40)[None], cache=cache)
    cache = [c.to_quantized(group_size=32, bits=8) if hasattr(c, "to_quantized") else c for c in cache]
    assert type(cache[0]).__name__ == "ArraysCache"
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache, {"model": "somewhere"})
    for bits, group, ok in ((8, 32, True), (4, 32, False), (None, 64, False)):
        args = argparse.Namespace(prompt_cache_file=path, kv_bits=bits, kv_group_size=group)
        if ok:
            _read_prompt_cache(args)
        else:
            with pytest.raises(ValueError, match="--kv-bits / --kv-group-size"):
                _read_prompt_cache(args)


def test_a_prompt_cache_whose_model_is_gone_is_named(tmp_path):
    """The cache's model folder moved: the error names the cache, not --model."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    made = str(tmp_path / "c.safetensors")
    assert cli("--prompt", "hi", "--max-tokens", "2", "--drafter", "none", "--save-prompt-cache", made).returncode == 0
    cache, metadata = load_prompt_cache(made, return_metadata=True)
    save_prompt_cache(made, cache, dict(metadata, model="/nonexistent/target"))
    r = cli("--model", "demo", "--prompt-cache-file", made, "--prompt", " x", "--max-tokens", "2")
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--prompt-cache-file" in lines[0] and "again" in lines[0], r.stderr
