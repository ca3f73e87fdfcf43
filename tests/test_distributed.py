"""Tree speculation on targets sharded with mlx.distributed (mlx-lm's `sharded_load`): two local
processes through `mlx.launch --backend ring`, tensor- and pipeline-parallel demo targets. Every
rank's speculative greedy output is the sharded target's own plain greedy output."""
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

mx = pytest.importorskip("mlx.core")

# (under pytest-xdist these should run on one worker; pytest 9 with xdist 3.8 splits the group
# over workers, so `one_ring` also serializes the launches themselves)
pytestmark = pytest.mark.xdist_group("mlx_launch")

from mlx_treespec.demo import demo_path  # noqa: E402

WORKER = Path(__file__).with_name("distributed_worker.py")
LAUNCHER = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))


def one_ring(cmd, timeout, **kwargs):
    """`subprocess.run(cmd)` (output captured as text) for an mlx.launch, one at a time on this
    machine: two rings at once take the same ports and both hang (a file lock, whatever worker
    runs the test). On a timeout the launcher's whole process group goes, so no rank is left
    spinning on a peer (and slowing every test after it)."""
    with open(Path(tempfile.gettempdir()) / "mlx_treespec_mlx_launch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(*args, timeout=240):
    out = one_ring([LAUNCHER, "--backend", "ring", "-n", "2", "--python", sys.executable, str(WORKER)]
                   + [str(a) for a in args], timeout=timeout)
    rows = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert out.returncode == 0 and len(rows) == 2, (out.stdout[-2000:], out.stderr[-2000:])
    return sorted(rows, key=lambda r: r["rank"])


def unsharded(model_name, dflash, names):
    """The same generations in this process, unsharded: (plain tokens, emitted per verify)."""
    import mlx_lm
    from distributed_worker import N, PROMPT, drafters
    from mlx_treespec import RoundStats, tree_generate_step

    model, tok = mlx_lm.load(demo_path(model_name))
    prompt = tok.encode(PROMPT)
    ref = [t for t, _, _ in tree_generate_step(prompt, model, None, max_tokens=N)]
    epv = {}
    for name in names.split(","):
        stats = RoundStats()
        list(tree_generate_step(prompt, model, drafters(dflash, model)[name](), max_tokens=N, stats=stats))
        epv[name] = stats.summary()["emitted_per_verify"]
    return ref, epv


@pytest.mark.parametrize("mode,model,names", [("tensor", "hybrid", "dflash"),  # the tensor-parallel target: the CLI test
                                              ("pipeline", "hybrid", "dflash,ddtree,auto")])
def test_sharded_targets_speculate_exactly(mode, model, names):
    # tensor parallel: attention and GatedDeltaNet heads split, all_sum inside the layers;
    # pipeline parallel: each rank holds half the layers, DFlash's captured rows are summed
    # over the ranks. Each rank drafts alike (the drafters are replicated: same inputs, same
    # trees), verifies the same tree, walks and commits alike
    folder = demo_path(model)  # the hybrid ships the weight index pipeline loading reads
    dflash = demo_path("dflash" if model == "target" else "hybrid_dflash")
    rows = launch(mode, folder, dflash, names)
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert rows[0]["emitted_per_verify"] == rows[1]["emitted_per_verify"]  # the ranks agree
    assert rows[0]["drafted"] == rows[1]["drafted"]  # and drafted the same trees
    for r in rows:
        assert all(r["identical"].values()) and len(r["identical"]) == len(names.split(",")), r
    if "auto" in names:  # the default drafts a fixed shape under a launch (alike on every rank)
        assert rows[0]["kinds"]["auto"] == "DFlashDrafter", rows[0]
        names = names.replace(",auto", "")
        for r in rows:
            r["emitted_per_verify"].pop("auto")
    ref, epv = unsharded(model, dflash, names)
    if mode == "pipeline":  # each layer computed whole: the unsharded numerics, bitwise (CPU)
        assert rows[0]["plain"] == ref and rows[0]["emitted_per_verify"] == epv
    else:  # partial sums in another order: the drafters still read the right rows
        assert rows[0]["emitted_per_verify"]["dflash"] >= 0.8 * epv["dflash"], (rows[0], epv)


def test_a_bad_launch_ends_every_process_with_one_clear_error():
    # processes that differ in their model, request or drafter raise the same error on every process,
    # naming what differs, before any collective of the model could hang; afterwards they still
    # agree. A process that leaves mid-generation ends the other's with an error (no hang: the
    # launch is bounded by the timeout), and its prompt cache holds what was delivered
    rows = launch("bad", "tensor", demo_path("hybrid"), demo_path("hybrid_dflash"), timeout=120)
    for r in rows:
        assert "differ in their model" in r["errors"]["model"], r
        assert "differ in their request" in r["errors"]["prompt"], r
        assert "differ in their drafter" in r["errors"]["drafter"], r
        assert r["errors"]["agreed"] is None, r
    left = rows[0]
    assert "connection to a peer was lost" in left["errors"]["peer_left"], left
    assert left["delivered"] >= 3 and left["delivered_are_plain"], left
    # a prefix of what was delivered (the pending tokens stay out: forwarding them would wait
    # on the process that left)
    assert left["prompt"] - 1 <= left["cache_offset"] < left["prompt"] + left["delivered"], left


def test_the_cli_shards_under_mlx_launch_and_rank_0_prints():
    # `--shard tensor` under mlx.launch: both ranks decode, rank 0 prints the text, which is the
    # unsharded CLI's up to the sharded sums' rounding (here: the same text)
    args = ["-m", "mlx_treespec.generate", "--model", "demo", "--prompt", "def parse(", "--max-tokens", "8",
            "--ignore-chat-template", "--temp", "0", "--drafter", "dflash", "--draft-block-size", "7"]  # (mlx.launch takes --verbose as its own flag)
    root = Path(__file__).resolve().parents[1]
    out = one_ring([LAUNCHER, "--backend", "ring", "-n", "2", "--cwd", str(root), "--python", sys.executable]
                   + args + ["--shard", "tensor"], timeout=240, cwd=root)
    alone = subprocess.run([sys.executable] + args, capture_output=True, text=True, timeout=240, cwd=root)
    assert alone.returncode == 0, alone.stderr[-2000:]

    def text(stdout):  # mlx-lm's verbose print: the text between two rules
        parts = stdout.split("==========")
        return parts[1].strip() if len(parts) == 3 else None

    # (mlx.launch exits 0 whatever its ranks do: the printed text is the check)
    assert out.stdout.count("==========") == 2, (out.stdout[-2000:], out.stderr[-2000:])  # rank 0 only
    assert text(out.stdout) and text(out.stdout) == text(alone.stdout)


def test_shard_outside_a_launch_is_a_one_line_error():
    from mlx_treespec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "demo", "--prompt", "x", "--shard", "tensor", "--max-tokens", "2"])
    assert e.value.code == 2


def test_the_model_digest_agrees_across_the_shards_of_a_split_head():
    # mlx-lm's shard splits an untied qwen3_5 head over the vocabulary (outside the decoder
    # layers): each process holds another slice, and the processes must still agree; a changed
    # replicated weight must still differ
    import tiny
    from mlx.utils import tree_flatten, tree_unflatten

    from mlx_treespec.launch import model_digest

    class Group:  # two processes of a launch, as mlx-lm's shard reads them (no collective runs)
        def __init__(self, rank):
            self._rank = rank

        def size(self):
            return 2

        def rank(self):
            return self._rank

    cfg = dict(tiny.CONFIGS["qwen3_5"], tie_word_embeddings=False)
    shards = []
    for rank in (0, 1):
        model = tiny.build(cfg)
        model.shard(group=Group(rank))
        shards.append(model)
    assert "Sharded" in type(shards[0].language_model.lm_head).__name__
    assert model_digest(shards[0]) == model_digest(shards[1])
    name, embed = next((k, v) for k, v in tree_flatten(shards[1].parameters()) if k.endswith("embed_tokens.weight"))
    shards[1].update(tree_unflatten([(name, embed.at[3].add(1.0))]))
    shards[1].__dict__.pop("_treespec_launch_digest_replicated")
    assert model_digest(shards[0]) != model_digest(shards[1])


def test_a_vocabulary_split_head_drafts_alike_on_every_process(tmp_path):
    # an untied qwen3_5 sharded tensor-parallel: mlx-lm splits its output head over the
    # vocabulary; a DFlash drafter binds that head and must gather it (drafters.target_io), or
    # each process would draft from its own slice and the processes would part ways
    import shutil as sh

    import tiny
    from mlx_lm.utils import save_config, save_model
    from test_dflash import dflash_config, save_random

    cfg = dict(tiny.CONFIGS["qwen3_5"], tie_word_embeddings=False, vocab_size=4096)
    folder = tmp_path / "untied"
    save_model(str(folder), tiny.build(cfg))
    save_config(dict(cfg), str(folder / "config.json"))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        sh.copy(Path(demo_path("target")) / f, folder / f)
    dflash = save_random(tmp_path / "dflash", dflash_config(cfg))
    rows = launch("tensor", folder, dflash, "dflash,ddtree")
    assert rows[0]["drafted"] == rows[1]["drafted"]  # the same trees on both processes
    assert rows[0]["emitted_per_verify"] == rows[1]["emitted_per_verify"]
    for r in rows:
        assert all(r["identical"].values()) and len(r["identical"]) == 2, r
