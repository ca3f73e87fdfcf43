"""The benchmark harness runs end to end (tiny settings, CPU), so a device call never meets a
broken script; on CPU every arm's tokens equal plain decoding's."""
import json
import os
import statistics
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_json(path):
    """The harness's raw output (gzipped JSON)."""
    import gzip

    with open(path, "rb") as f:
        return json.loads(gzip.decompress(f.read()))


def short_prompts(tmp_path, *sets, chars=80):
    """Each set's first prompts cut to `chars` characters, as files (a path names its set): a
    whole prompt's prefill took most of a tiny run here."""
    from mlx_treespec.harness import load_prompts

    paths = []
    for name in sets:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps([t[:chars] for t in load_prompts(name)[:2]]))
        paths.append(str(path))
    return paths


def run_here(capsys, args):
    """`run(args)` in this process (bench/run.py's `main`): its stdout."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import main

    capsys.readouterr()
    main(args)
    return capsys.readouterr().out


def run(args):
    out = subprocess.run([sys.executable, "bench/run.py"] + args, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_loop_section_tiny(tmp_path):
    # (one prompt a set, few tokens: the shipped 8-bit draft model runs ~20x slower than float on CPU)
    arms = "plain,mlx-chain:2,chain:2+lookup4@2,lookup:8:4,dflash:7,ddtree:12"
    unseen_file, heldout_file = short_prompts(tmp_path, "unseen", "heldout")
    text = run(["loop", "--arms", arms, "--prompts", f"{unseen_file},{heldout_file}", "--n", "1", "--max-tokens", "8",
                "--versus", "dflash:7", "--out", str(tmp_path / "loop")])
    assert f"## {unseen_file} prompts" in text and f"## {heldout_file} prompts" in text
    data = read_json(tmp_path / "loop.json.gz")
    assert data["meta"]["commit"] and data["meta"]["mlx"] and data["meta"]["device"] == "cpu"
    for pset in (unseen_file, heldout_file):
        rows = {r["arm"]: r for r in data["sets"][pset]["arms"]}
        assert set(rows) == {"mlx-plain"} | set(arms.split(","))
        for name, r in rows.items():  # CPU verifies are bitwise: no arm diverges
            assert r["identical"] == "1/1" and all(d is None for d in r["first_divergence"]), name
        assert rows["mlx-plain"]["x_plain"]["median"] == 1.0
        run0 = rows["ddtree:12"]["runs"][0]  # one draft forward a round (none in a last, empty one)
        assert (run0["rounds"] - 1) / run0["rounds"] - 1e-4 <= rows["ddtree:12"]["draft_forwards"]["median"] <= 1.0
        # the slowest round: at least the mean, and one of the run's
        assert run0["slowest_round"]["ms"] >= run0["round_ms"] and 0 <= run0["slowest_round"]["index"] < run0["rounds"]
        # which verifies ran compiled: none asks on CPU (whole-buffer forwards are the GPU's path)
        assert rows["ddtree:12"]["compiled_verifies"] is None and data["sets"][pset]["eager_shapes"] == []
    assert (tmp_path / "loop.md").read_text().startswith("# loop: demo")
    # --versus: each arm's tok/s over that arm's on the same prompt, in the loop's table and in
    # `table`'s rendering of the saved run against another arm
    rows = {r["arm"]: r for r in data["sets"][unseen_file]["arms"]}

    def tok_s(arm):
        (r,) = rows[arm]["runs"]
        return (r["tokens"] - 1) / r["decode_s"]

    def cell(md, arm):
        line = next(x for x in md.splitlines() if x.startswith(f"| {arm} |"))
        return float(line.split("|")[3].split()[0])

    unseen = text.split(f"## {heldout_file}")[0]
    assert "x dflash:7 (median, min-max)" in unseen and cell(unseen, "dflash:7") == 1.0
    assert "| verifies compiled |" in unseen
    assert cell(unseen, "ddtree:12") == pytest.approx(tok_s("ddtree:12") / tok_s("dflash:7"), abs=0.006)
    # its geometric mean over prompts with a bootstrap interval (one prompt: a point)
    line = next(x for x in unseen.splitlines() if x.startswith("| ddtree:12 |"))
    g, lo, hi = map(float, line.split("|")[4].replace("[", " ").replace("]", " ").replace("-", " ").split())
    assert g == pytest.approx(tok_s("ddtree:12") / tok_s("dflash:7"), abs=0.0006) and lo == hi == g
    again = run(["table", "--from", str(tmp_path / "loop.json.gz"), "--versus", "ddtree:12"]).split(f"## {heldout_file}")[0]
    assert cell(again, "dflash:7") == pytest.approx(tok_s("dflash:7") / tok_s("ddtree:12"), abs=0.006)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import main

    with pytest.raises(SystemExit, match="--versus chain:9 is not an arm"):
        main(["table", "--from", str(tmp_path / "loop.json.gz"), "--versus", "chain:9"])
    with pytest.raises(SystemExit, match="--versus chain:9 is not one of --arms"):
        main(["loop", "--arms", "plain,dflash:7", "--versus", "chain:9"])


def test_interleaved_arms_follow_every_other_arm_equally_often():
    # a plain rotation had each arm always run right after the same one (whatever an arm
    # leaves behind, its garbage or a warm cache, weighed on one arm): over a cycle of
    # prompts every arm runs in every position and after every other arm equally often
    from collections import Counter

    from mlx_treespec.harness import interleave

    for n in range(1, 7):
        names = [f"arm{a}" for a in range(n)]
        seen = []
        cycle = 2 * n if n % 2 else n
        said = []
        got = interleave(names, list(range(cycle)), lambda name, i, pos: seen.append((i, pos, name)) or (i, pos),
                         log=lambda m: None, progress=said.append)
        assert said == [f"prompt {i + 1}/{cycle} {name}" for i, _, name in seen]
        assert all([i for i, _ in got[a]] == list(range(cycle)) for a in names)  # every arm, every prompt
        runs = [[name for j, _, name in seen if j == i] for i in range(cycle)]
        assert all(sorted(r) == names for r in runs)
        positions = Counter((name, pos) for _, pos, name in seen)
        follows = Counter((r[k], r[k + 1]) for r in runs for k in range(n - 1))
        assert len(set(positions.values())) == 1 and len(positions) == n * n
        assert len(set(follows.values())) <= 1 and len(follows) == n * (n - 1)


def test_ratio_interval_brackets_the_geometric_mean():
    from mlx_treespec.harness import ratio_interval

    assert ratio_interval([]) is None and ratio_interval([float("nan"), 0.0]) is None
    same = ratio_interval([1.25] * 6)
    assert same["geomean"] == pytest.approx(1.25) and same["lo"] == pytest.approx(1.25) == same["hi"]
    rng = np.random.default_rng(3)
    faster = list(1.06 * np.exp(rng.normal(0, 0.02, 40)))  # robustly above 1
    i = ratio_interval(faster)
    assert 1 < i["lo"] < i["geomean"] < i["hi"] and i["n"] == 40
    assert i["geomean"] == pytest.approx(float(np.exp(np.mean(np.log(faster)))))
    noisy = [0.8, 1.3, 0.9, 1.25]  # a geometric mean above 1 whose interval holds 1
    j = ratio_interval(noisy)
    assert j["lo"] < 1 < j["hi"] and ratio_interval(noisy) == j  # seeded: renders the same again
    assert ratio_interval(faster, level=0.5)["hi"] < i["hi"]


def test_comm_section_tiny(tmp_path):
    # the demo hybrid tensor-parallel over two local processes: collectives counted per round
    text = run(["comm", "--target", "demo-hybrid", "--shard", "tensor", "--arms", "plain,dflash:7", "--prompts",
                *short_prompts(tmp_path, "unseen"),
                "--n", "1", "--max-tokens", "8", "--out", str(tmp_path / "comm")])
    assert "## tensor parallel (1 prompts x 8 tokens)" in text and "A broadcast of one round's tree" in text
    arms = read_json(tmp_path / "comm.json.gz")["modes"]["tensor"]["arms"]
    assert arms["plain"]["identical"] == arms["dflash:7"]["identical"] == "1/1"
    # two all_sums per layer and target forward (8 layers); a round is one forward
    assert arms["plain"]["per_forward"]["all_sum"][0] == arms["dflash:7"]["per_forward"]["all_sum"][0] == 16
    assert arms["dflash:7"]["per_round"]["all_sum"][0] == 16


def test_acceptance_section_tiny(tmp_path):
    (unseen,) = short_prompts(tmp_path, "unseen")
    text = run(["acceptance", "--arms", "tree:3:8,ddtree:31", "--prompts", unseen, "--n", "1",
                "--max-tokens", "12", "--ratio", "ddtree:31/tree:3:8", "--out", str(tmp_path / "acc")])
    assert "ddtree:31 / tree:3:8 = " in text
    data = read_json(tmp_path / "acc.json.gz")
    assert all(r["identical"] == "1/1" for r in data["sets"][unseen]["arms"])
    # `table --from` prints an acceptance run's table again (a loop's --versus is refused)
    again = run(["table", "--from", str(tmp_path / "acc.json.gz")])
    assert "| arm | emitted/verify | rounds | identical to plain |" in again and "| ddtree:31 | " in again
    bad = subprocess.run([sys.executable, "bench/run.py", "table", "--from", str(tmp_path / "acc.json.gz"),
                          "--versus", "plain"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "drop --versus" in bad.stderr


def test_an_arm_picks_its_drafters_folder(tmp_path):
    # --mtp A,B: arm/d2 drafts with B (here a head of zeros, which drafts token 0 every step)
    import shutil

    import mlx.core as mx

    from mlx_treespec.demo import demo_path

    zero = tmp_path / "zero_head"
    shutil.copytree(demo_path("hybrid"), zero, symlinks=False)
    head = mx.load(str(zero / "model-mtp.safetensors"))
    mx.save_safetensors(str(zero / "model-mtp.safetensors"), {k: mx.zeros_like(v) for k, v in head.items()})
    run(["acceptance", "--target", "demo-hybrid", "--mtp", f"demo-hybrid,{zero}", "--arms",
         "mtp-chain:4,mtp-chain:4/d2", "--prompts", "unseen", "--n", "1", "--max-tokens", "16",
         "--out", str(tmp_path / "acc")])
    arms = {r["arm"]: r for r in read_json(tmp_path / "acc.json.gz")["sets"]["unseen"]["arms"]}
    assert arms["mtp-chain:4"]["emitted_per_verify"] > 2 > arms["mtp-chain:4/d2"]["emitted_per_verify"]
    assert all(r["identical"] == "1/1" for r in arms.values())


def test_the_matmul_and_kernel_arms_run_their_rule_in_traces_of_their_own(tmp_path, monkeypatch):
    # ARM/matmul (join.few_rows off for its generations): the rule is asked in the arm without
    # the suffix and not in it; ARM/kernel: its forwards run with the tree-attention kernel's
    # width bound at 0 (the kernel at any width, on CUDA); each put back after it, and the
    # tokens are the same
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import Arms, encode_prompts, load_target, run_once

    from mlx_treespec.harness import load_prompts

    import mlx_treespec.join as joining
    from mlx_treespec import attention

    asked, width, rows = [], attention.MIN_WIDTH, attention.STEP_ROWS
    spy = lambda x, weight: asked.append(attention.MIN_WIDTH) and False  # noqa: E731
    monkeypatch.setattr(joining, "_products_here", spy)
    (unseen,) = short_prompts(tmp_path, "unseen")
    target, tok = load_target("demo")
    texts = load_prompts(unseen)[:1]
    arms = Arms(target, "demo", texts, None, None, dict(mtp=None, eagle3=None))
    prompt = encode_prompts(tok, texts)[0]
    outs = {}
    tree = "eagle3-tree:3:3:7:2"
    for arm in (tree, tree + "/matmul", tree + "/kernel", tree + "/stepkernel", tree):
        asked.clear()
        drafter = arms.maker(arm)()
        outs.setdefault(arm, []).append(run_once(target, drafter, prompt, 12)[0])
        assert (len(asked) > 0) == (not arm.endswith("/matmul")), arm
        assert set(asked) <= {0 if arm.endswith("/kernel") else width} and width > 0, (arm, set(asked))
        assert joining._products_here is spy and attention.MIN_WIDTH == width and attention.STEP_ROWS == rows
    assert outs[tree][0] == outs[tree + "/matmul"][0] == outs[tree + "/kernel"][0] == outs[tree][1]
    assert outs[tree + "/stepkernel"][0] == outs[tree][0]
    # ARM/stepkernel: the kernel at any width for up to FEW_ROWS query rows, ARM/nostepkernel
    # for none (on CUDA it then takes or leaves a draft step's attention; CPU never asks, so
    # the rule is asked here directly, a variant marked checked)
    monkeypatch.setattr(attention, "_checked", {(mx.float16, 64): True})
    k = mx.zeros((1, 2, 256, 64), mx.float16)

    def taken(arm):
        with arms.maker(tree + arm)().separate():
            return [attention.fits(q, k, k, mx.zeros((q.shape[2], 256), mx.float16), steps=True) for q in
                    (mx.zeros((1, 2, r, 64), mx.float16) for r in (1, joining.FEW_ROWS, joining.FEW_ROWS + 1))]

    assert taken("/stepkernel") == [True, True, False] and taken("/nostepkernel") == [False, False, False]
    assert attention.STEP_ROWS == rows == 1 and attention.MIN_WIDTH == width > 256


def test_verify_counts_read_an_ab_arms_own_store_too():
    # an A/B arm's compiled verifies are kept under its own key between its generations
    # (Separate): a generation's counts are the difference of the sums, whichever store it ran
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import verify_counts

    class Target:
        pass

    t = Target()
    assert verify_counts(t) == (0, 0)
    t.__dict__["_treespec_compiled_verify"] = dict(trusted_runs=3, calls=4)
    before = verify_counts(t)
    t.__dict__[("kernel", "_treespec", "_treespec_compiled_verify")] = dict(trusted_runs=5, calls=6)
    t.__dict__[("kernel", "_treespec", "_treespec_drafts")] = dict(trusted_runs=100, calls=100)  # (not a verify's)
    assert before == (3, 4) and verify_counts(t) == (8, 10)


def test_proj_section_tiny(tmp_path, capsys):
    # the projection arithmetic over tiny random shapes, for each drafter family (in process)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import tiny
    from test_dflash import dflash_config

    acc = {"sets": {"unseen": {"arms": [
        {"arm": "dflash:7", "pooled_emitted_per_verify": 3.0}, {"arm": "ddtree:12", "pooled_emitted_per_verify": 3.5},
        {"arm": "ddtree:12/sync", "pooled_emitted_per_verify": 3.5},
        {"arm": "mtp-chain:3", "pooled_emitted_per_verify": 2.0},
        {"arm": "mtp-tree:3:3:9:1", "pooled_emitted_per_verify": 2.4},
        {"arm": "eagle3-tree:2:3:6:2", "pooled_emitted_per_verify": 2.2}]}}}
    (tmp_path / "acc.json").write_text(json.dumps(acc))
    eagle = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=tiny.VOCAB, draft_vocab_size=40, target_hidden_size=64,
                 eagle_aux_hidden_state_layer_ids=[0, 1, 1])
    files = {"qwen3": tiny.CONFIGS["qwen3"], "qwen3_5": tiny.CONFIGS["qwen3_5"],
             "dflash": dflash_config(tiny.CONFIGS["qwen3"]), "eagle3": eagle}
    for name, cfg in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
    for family, target, head, want in (("dflash", "qwen3", "dflash", ["dflash:7", "ddtree:12"]),
                                       ("mtp", "qwen3_5", None, ["mtp-chain:3", "mtp-tree:3:3:9:1"]),
                                       ("eagle3", "qwen3", "eagle3", ["eagle3-tree:2:3:6:2"])):
        args = ["proj", "--acceptance", str(tmp_path / "acc.json"), "--family", family,
                "--config", str(tmp_path / f"{target}.json"), "--q-bits", "0", "--dtype", "float32",
                "--history", "32", "--out", str(tmp_path / family)]
        text = run_here(capsys, args + (["--head-config", str(tmp_path / f"{head}.json")] if head else []))
        data = read_json(tmp_path / f"{family}.json.gz")
        rows = data["variants"][0]["arms"]
        assert [r["arm"] for r in rows] == want and all(r["x_plain"] > 0 for r in rows), text
        for r in rows:  # x plain = emitted per verify x plain ms / round ms (stored at 5 digits)
            want_x = r["tau"] * data["variants"][0]["plain_ms"] / r["round_ms"]
            assert abs(r["x_plain"] - want_x) <= 1e-4 * want_x
    # --draft-q-bits: the drafter quantized apart from the target, one variant each, one target
    run_here(capsys, ["proj", "--acceptance", str(tmp_path / "acc.json"), "--family", "dflash", "--config",
         str(tmp_path / "qwen3.json"), "--head-config", str(tmp_path / "dflash.json"), "--q-bits", "0",
         "--draft-q-bits", "0,8", "--dtype", "float32", "--history", "32", "--arms", "ddtree:12",
         "--out", str(tmp_path / "dq")])
    vs = read_json(tmp_path / "dq.json.gz")["variants"]
    assert [v["variant"] for v in vs] == ["float32", "float32; drafter 8-bit"]
    assert [(v["target_bits"], v["drafter_bits"]) for v in vs] == [(None, None), (None, 8)]
    assert vs[0]["plain_ms"] == vs[1]["plain_ms"] and all([r["arm"] for r in v["arms"]] == ["ddtree:12"] for v in vs)
    with pytest.raises(SystemExit, match="--arms ddtree:99: not dflash arms of"):
        run_here(capsys, ["proj", "--acceptance", str(tmp_path / "acc.json"), "--family", "dflash", "--arms", "ddtree:99"])
    # --rounds: each arm's whole rounds timed, the arms and plain decoding in turn (an ARM/sync
    # arm through the round loop; on CPU no round queues), and a queued tree round's own pieces
    run_here(capsys, ["proj", "--acceptance", str(tmp_path / "acc.json"), "--family", "dflash", "--config",
         str(tmp_path / "qwen3.json"), "--head-config", str(tmp_path / "dflash.json"), "--q-bits", "0", "--dtype",
         "float32", "--history", "32", "--rounds", "--round-reps", "2", "--out", str(tmp_path / "rounds")])
    v = read_json(tmp_path / "rounds.json.gz")["variants"][0]
    arms = ["dflash:7", "ddtree:12", "ddtree:12/sync"]
    assert [r["arm"] for r in v["arms"]] == arms and all(len(v["draft"]["round_ms"][a]) == 2 for a in arms)
    # (stored at 5 significant digits)
    assert [r["round_ms"] for r in v["arms"]] == pytest.approx([statistics.median(v["draft"]["round_ms"][a]) for a in arms], rel=1e-4)
    assert len(v["draft"]["plain_ms"]) == 2 and v["plain_ms"] == pytest.approx(statistics.median(v["draft"]["plain_ms"]), rel=1e-4)
    assert set(v["draft"]["tree_pieces_ms"]) >= {"top-k", "build", "walk"} and all(r["round_ms"] > 0 for r in v["arms"])
    # each arm's share of verifies run compiled (None where no verify asked for it: on CPU)
    assert all(r["verifies_compiled"] is None or 0 <= r["verifies_compiled"] <= 1 for r in v["arms"])
    assert "eager_shapes" in v
    # a head's whole rounds too (over a hybrid target here); an arm over a draft vocabulary the
    # file lacks is priced at its whole-vocabulary arm's figure, and says so
    arms = ["mtp-chain:3", "mtp-tree:3:3:9:1", "mtp-chain:3+vocab40"]
    run_here(capsys, ["proj", "--acceptance", str(tmp_path / "acc.json"), "--family", "mtp", "--config", str(tmp_path / "qwen3_5.json"),
         "--q-bits", "0", "--dtype", "float32", "--history", "32", "--rounds", "--round-reps", "1",
         "--arms", ",".join(arms), "--out", str(tmp_path / "mtp_rounds")])
    v = read_json(tmp_path / "mtp_rounds.json.gz")["variants"][0]
    assert [r["arm"] for r in v["arms"]] == arms and all(len(v["draft"]["round_ms"][a]) == 1 for a in arms)
    assert [r["round_ms"] for r in v["arms"]] == pytest.approx([v["draft"]["round_ms"][a][0] for a in arms], rel=1e-4)
    assert [(r["tau"], r["tau_of"]) for r in v["arms"]] == [(2.0, None), (2.4, None), (2.0, "mtp-chain:3")]
    assert [r["draft_ms"] is None for r in v["arms"]] == [False, False, True]  # (no whole-vocabulary estimate)
    assert "mtp-chain:3+vocab40 (at mtp-chain:3's)" in (tmp_path / "mtp_rounds.md").read_text()
    with pytest.raises(SystemExit, match="add --rounds"):
        run_here(capsys, ["proj", "--acceptance", str(tmp_path / "acc.json"), "--family", "mtp", "--arms",
                          "mtp-chain:3+vocab40"])
    # head-step: a head's step over the whole vocabulary and over a draft vocabulary, both families
    (tmp_path / "eagle3_whole.json").write_text(json.dumps(dict(eagle, draft_vocab_size=tiny.VOCAB)))
    run_here(capsys, ["head-step", "--config", f"{tmp_path / 'qwen3_5.json'},{tmp_path / 'qwen3.json'}", "--head-config",
         str(tmp_path / "eagle3_whole.json"), "--q-bits", "0", "--dtype", "float32", "--draft-vocab", "40",
         "--rows", "1,3", "--round-reps", "2", "--history", "16", "--out", str(tmp_path / "step")])
    rows = read_json(tmp_path / "step.json.gz")["rows"]
    assert [(r["shape"].split(",")[0], r["rows"]) for r in rows] == [("qwen3_5", 1), ("qwen3_5", 3), ("qwen3", 1), ("qwen3", 3)]
    assert all(len(r["whole_ms"]) == len(r["draft_ms"]) == 2 and min(r["whole_ms"] + r["draft_ms"]) > 0 for r in rows)


def test_derived_prompt_sets():
    from mlx_treespec.harness import load_prompts

    unseen, heldout = load_prompts("unseen"), load_prompts("heldout")
    editing, long = load_prompts("editing"), load_prompts("long")
    assert len(editing) == len(unseen) and editing[0].startswith(unseen[0] + "\n\n")
    total = sum(len(t) + 2 for t in unseen + heldout + unseen) - 2
    assert len(long) == 4 and len(long[0]) == total and long[0].startswith(unseen[0]) and heldout[0] in long[0]


def test_bound_section_tiny(tmp_path):
    (unseen,) = short_prompts(tmp_path, "unseen")
    text = run(["bound", "--target", "demo", "--arms", "eagle3", "--prompts", unseen, "--n", "1",
                "--max-tokens", "12", "--depth", "3", "--nodes-list", "2,6", "--out", str(tmp_path / "b")])
    assert "| 2 |" in text and "(of 3)" in text
    data = read_json(tmp_path / "b.json.gz")["sets"][unseen]
    assert data["positions"] == 12 - 3 + 1  # round starts: the prompt's last token, then each generated one with 3 after it
    assert [(r["nodes"], r["chain_nodes"]) for r in data["rows"]] == [(2, 2), (6, 3)]


def test_head_ranks_are_a_fresh_head_pass_over_each_prefix():
    # each position's ranks, against the head run afresh over that prefix alone (its own first
    # pass, then one step over its output hidden): the sliced cache and the token / row indices
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_treespec.verify import capturing
    from run import Arms, head_ranks, load_target

    target, tok = load_target("demo")
    head = Arms(target, "demo", []).head("eagle3")
    prompt, depth, n = tok.encode("def parse(text):\n    return"), 2, 6
    ranks = head_ranks(target, head, prompt, n, depth)
    s = prompt + [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=n)]
    starts = range(len(prompt) - 2, len(s) - depth - 1)  # every start whose `depth` tokens exist
    assert len(ranks) == len(starts)
    with capturing(target, head.capture) as cap:
        target(mx.array(s)[None])
        rows = cap.hidden()
    for r, t in zip(ranks, starts):
        cache = head.make_cache()
        lg = head(mx.array(s[1 : t + 2])[None], cache=cache, hidden=rows[: t + 1][None], first=True)[0, -1]
        want = [int(mx.sum(lg > lg[s[t + 2]]).item())]
        lg = head(mx.array([[s[t + 2]]]), cache=cache, hidden=head.out_hidden[:, -1:], first=False)[0, 0]
        want.append(int(mx.sum(lg > lg[s[t + 3]]).item()))
        assert list(r) == [min(x, 8) for x in want], t


def test_rank_rounds_and_the_best_rank_tree():
    # bound's simulation. One prompt, 8 round-start positions: the head's second choice is
    # right at depth 1 half the time
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import best_rank_tree, rank_rounds

    seqs = [(0, 0), (1, 0), (0, 0), (1, 0), (0, 5), (1, 5), (5, 0), (0, 0)]
    emitted, starts = rank_rounds([seqs], {(0,), (0, 0)})
    # rounds start at 0 (accepts 2: emits 3), 3 (rank 1: emits 1), 4 (emits 2), 6 (emits 1), 7 (emits 3)
    assert starts == [seqs[0], seqs[3], seqs[4], seqs[6], seqs[7]]
    assert emitted == (3 + 1 + 2 + 1 + 3) / 5
    assert best_rank_tree(starts, 2, cap=8) == [(0,), (0, 0)]  # (0,) at 3 starts, (0, 0) at 2, (1,) at 1
    # a parent before its children: (1, 0) only under (1,); in the order taken
    assert best_rank_tree([(1, 0), (1, 0), (0, 3)], 2, cap=8) == [(1,), (1, 0)]
    assert best_rank_tree([(8, 0)], 3, cap=8) == []  # rank cap: no node holds it
    emitted, _ = rank_rounds([[(1, 0), (1, 0), (0, 0)]], {(1,), (1, 0)})
    assert emitted == 3.0  # the first round emits 3 and ends the prompt


def test_proj_prices_each_arm_at_its_own_verify_rows():
    # proj's verify for an arm's round: its nodes, root included, rounded up to a timed row
    # count, up to MAX_NODES (a tree past 64 nodes is priced at its own rows, not at 64)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import _verify_rows
    from mlx_treespec.spec import DraftSpec

    rows = {a: _verify_rows(DraftSpec.parse(a)) for a in ("dflash:15", "ddtree", "ddtree:31", "ddtree:63",
                                                           "ddtree:127", "ddtree:255", "mtp-tree:3:15:45:1")}
    assert rows == {"dflash:15": 16, "ddtree": 32, "ddtree:31": 32, "ddtree:63": 64, "ddtree:127": 128,
                    "ddtree:255": 256, "mtp-tree:3:15:45:1": 64}


def test_proj_from_costs_refuses_an_arm_past_its_timed_rows(tmp_path):
    # proj --costs prices a round at the smallest timed verify that holds its nodes; an arm with
    # more nodes than any timed verify is refused by name, not priced at the largest
    import gzip

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import main

    def acceptance(name, arms):
        path = tmp_path / name
        rows = [dict(arm=a, pooled_emitted_per_verify=t) for a, t in arms.items()]
        path.write_bytes(gzip.compress(json.dumps(dict(meta={}, sets=dict(unseen=dict(arms=rows)))).encode()))
        return str(path)

    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(dict(variants={"bf16": dict(plain_ms=10.0, dflash_draft_ms=1.0,
                                                            verify_ms={"32": 20.0, "64": 22.0})})))
    main(["proj", "--acceptance", acceptance("a.json.gz", {"ddtree:31": 6.0, "ddtree:63": 6.5}), "--costs", str(costs),
          "--overhead-ms", "0", "--out", str(tmp_path / "p")])
    (v,) = read_json(tmp_path / "p.json.gz")["variants"]
    assert {a["arm"]: a["round_ms"] for a in v["arms"]} == {"ddtree:31": 21.0, "ddtree:63": 23.0}
    # a comma list of acceptance files: each arm's figure from the first file that has it
    main(["proj", "--acceptance", ",".join([acceptance("a.json.gz", {"ddtree:31": 6.0, "ddtree:63": 6.5}),
                                            acceptance("c.json.gz", {"ddtree:63": 9.9, "ddtree:15": 5.0})]),
          "--costs", str(costs), "--overhead-ms", "0", "--out", str(tmp_path / "m")])
    (v,) = read_json(tmp_path / "m.json.gz")["variants"]
    assert {a["arm"]: a["tau"] for a in v["arms"]} == {"ddtree:31": 6.0, "ddtree:63": 6.5, "ddtree:15": 5.0}
    with pytest.raises(SystemExit, match="arm ddtree:127 verifies 128"):
        main(["proj", "--acceptance", acceptance("b.json.gz", {"ddtree:31": 6.0, "ddtree:127": 7.0}),
              "--costs", str(costs), "--out", str(tmp_path / "q")])


def test_round_host_and_a_chain_queued_as_a_tree(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from run import Arms, ChainAsTree, encode_prompts, load_prompts, load_target, main, verify_counts

    import mlx_treespec.queued as queued
    import mlx_treespec.verify as verify
    from mlx_treespec.harness import generate_once

    # round-host: where a queued round's host time goes, each piece timed, each round's kernels
    # counted; the library's functions are put back after each run
    import functools

    import run

    # (the launch table at 8 chained ops a kind, not 200: CPU timings are not its point here)
    monkeypatch.setattr(run, "launch_costs", functools.partial(run.launch_costs, 8))
    (unseen,) = short_prompts(tmp_path, "unseen")
    with pytest.raises(SystemExit, match="ran no queued round"):
        main(["round-host", "--target", "demo", "--arms", "eagle3-chain:3", "--prompts", unseen, "--n", "1", "--max-tokens", "2",
              "--out", str(tmp_path / "none")])
    monkeypatch.setattr(verify, "pad_keys_default", lambda: True)
    import mlx_treespec.join as joining

    kept = (queued.compiled_forward, queued.walk, queued._replay_layout, queued._spine_layout,
            queued.replay_prefix, mx.async_eval, joining.running)
    # (--split-launch: each piece's kernels launched as it returns, each launch timed; `launch`
    # is their sum. One run for both: each run loads the target and traces every arm again)
    main(["round-host", "--target", "demo", "--arms",
          "eagle3-chain:3,eagle3-chain:3/astree,eagle3-tree:2:3:6:1,eagle3-chain:3/separate", "--split-launch",
          "--prompts", unseen, "--n", "1", "--max-tokens", "8", "--out", str(tmp_path / "rh")])
    assert (queued.compiled_forward, queued.walk, queued._replay_layout, queued._spine_layout,
            queued.replay_prefix, mx.async_eval, joining.running) == kept
    rows = {r["arm"]: r for r in read_json(tmp_path / "rh.json.gz")["arms"]}
    assert list(rows) == ["eagle3-chain:3", "eagle3-chain:3/astree", "eagle3-tree:2:3:6:1", "eagle3-chain:3/separate"]
    for arm, r in rows.items():
        assert len(r["runs"]) == 1 and r["round"] > 0 and r["draft"] > 0 and r["verify"] > 0 and r["launch"] > 0
        assert ("walk" in r) == ("layout" in r) == ("tree" in arm or "astree" in arm) and r["kernels"] < r["primitives"]
        assert r.get("layout", 1) > 0  # (a one-lane tree's layout is timed too)
    split = rows["eagle3-tree:2:3:6:1"]
    pieces = [k for k in split if k.endswith(" launch")]
    assert {"draft launch", "verify launch", "walk launch", "rest launch"} <= set(pieces)
    assert split["draft launch"] > 0 and split["verify launch"] > 0
    assert 0 < split["rest launch"] < split["launch"]  # (the pieces launched their own kernels first)
    assert "| draft launch |" in (tmp_path / "rh.md").read_text()
    launches = read_json(tmp_path / "rh.json.gz")["launches"]  # (one row, a chain step's, as products)
    assert launches["1 x [1, 384] @ [384, 1024] gather_mm (+ add)"]["launch_us"] > 0
    # the chain as a tree runs the chain's tokens through the tree's machinery: more kernels on
    # CPU, where the walk is MLX ops (on a GPU one kernel: the H200 counted the chain's)
    assert rows["eagle3-chain:3/astree"]["kernels"] > rows["eagle3-chain:3"]["kernels"]
    assert rows["eagle3-chain:3/astree"]["emitted_per_verify"] == rows["eagle3-chain:3"]["emitted_per_verify"]
    # ARM/separate: every linear layer on its own (join.py's A/B arm), the same tokens; a round
    # launches more kernels: per target layer two for q/k/v, one for gate/up, and the head's
    # three a step
    separate = rows["eagle3-chain:3/separate"]
    assert separate["emitted_per_verify"] == rows["eagle3-chain:3"]["emitted_per_verify"]
    assert separate["kernels"] == rows["eagle3-chain:3"]["kernels"] + 3 * 8 + 3 * 3
    assert "| eagle3-tree:2:3:6:1 |" in (tmp_path / "rh.md").read_text()
    # HEAD-chain:K/astree: the head's chain queued as a tree (the queued path, as on a GPU):
    # plain decoding's tokens in the chain's rounds; only a head's chain arm takes it
    target, tok = load_target("demo")
    arms = Arms(target, "demo", [])
    # TREE/ranked: EAGLE-2's lanes ranked at every step, the A/B arm of the library's rule
    # (ranked at the first lane step only); a chain or a one-lane tree has no lanes to rank
    assert arms.maker("eagle3-tree:2:4:8:2/ranked")().ranked_lane_steps == 4
    assert arms.maker("eagle3-tree:2:4:8:2")().ranked_lane_steps == 1
    for arm in ("eagle3-chain:3/ranked", "eagle3-tree:2:4:8:1/ranked"):
        with pytest.raises(ValueError, match="ARM/ranked takes a tree arm of two or more lanes"):
            arms.maker(arm)()
    # ARM/auto: adaptive drafting over that shape, learning apart from the default's
    from mlx_treespec.adaptive import AdaptiveDrafter

    auto, default = arms.maker("eagle3-chain:12/auto")(), arms.maker("auto:eagle3")()
    assert isinstance(auto, AdaptiveDrafter) and (auto.primary.topk, auto.primary.depth) == (1, 12)
    assert (default.primary.topk, default.primary.depth) == (3, 8) and auto.learned is not default.learned
    with pytest.raises(ValueError, match="ARM/auto takes"):
        arms.maker("ddtree:12/auto")
    prompt = encode_prompts(tok, load_prompts("unseen")[:1])[0][:24]
    want = [int(t) for t, _ in generate_step(mx.array(prompt), target, max_tokens=16)]
    target.__dict__.pop("_treespec_compiled_verify", None)
    chain, chain_stats, _ = generate_once(target, arms.maker("eagle3-chain:4")(), prompt, 16)
    compiled, calls = verify_counts(target)  # every verify asked; those past their checks ran compiled
    assert calls == chain_stats.rounds + 1 and compiled == calls - verify.CHECKS
    drafter = arms.maker("eagle3-chain:4/astree")()
    drafted = []
    ahead = type(drafter).ahead
    monkeypatch.setattr(type(drafter), "ahead", lambda self, *a: drafted.append(1) or ahead(self, *a))
    tree, tree_stats, _ = generate_once(target, drafter, prompt, 16)
    assert tree == chain == want and tree_stats.emitted == chain_stats.emitted and drafted
    assert set(tree_stats.drafter) == {"queued"}
    with pytest.raises(ValueError, match="a head's chain arm"):
        ChainAsTree(arms.maker("eagle3-tree:2:4:8:1")())
    # TREE/replay: a one-lane tree's paths re-run by the next round (the replay layout), where
    # the library commits them in place: the same tokens and acceptance
    replayed = []
    monkeypatch.setattr(queued, "_replay_layout", lambda *a: replayed.append(1) or kept[2](*a))
    in_place, in_place_stats, _ = generate_once(target, arms.maker("eagle3-tree:2:4:8:1")(), prompt, 16)
    assert not replayed
    again, again_stats, _ = generate_once(target, arms.maker("eagle3-tree:2:4:8:1/replay")(), prompt, 16)
    assert again == in_place == want and again_stats.emitted == in_place_stats.emitted and replayed
    assert set(again_stats.drafter) == {"queued"}
    with pytest.raises(ValueError, match="ARM/replay takes"):
        arms.maker("eagle3-chain:4/replay")()
    with pytest.raises(ValueError, match="no /sync"):
        arms.maker("eagle3-chain:4/sync/astree")


def test_topk_section_tiny(tmp_path):
    # argpartition against argmaxes: one row per width and row count, both timed (the section
    # asserts the two pick the same runners-up before it times them)
    run(["topk", "--rows", "1,3", "--widths", "64", "--out", str(tmp_path / "k")])
    rows = read_json(tmp_path / "k.json.gz")["rows"]
    assert [(r["width"], r["rows"]) for r in rows] == [(64, 1), (64, 3)]
    assert all(r["argpartition"] > 0 and r["argmax"] > 0 for r in rows)


def test_attn_section_tiny(tmp_path):
    # fused against composed attention: one row per shape, width and row count, both timed; on
    # CPU the composed arithmetic is the fused call's, bit for bit (what the section compares)
    import mlx.core as mx

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import composed_attention

    run(["attn", "--rows", "1,3", "--widths", "16", "--out", str(tmp_path / "a")])
    rows = read_json(tmp_path / "a.json.gz")["rows"]
    assert [(r["width"], r["rows"]) for r in rows] == [(16, 1), (16, 3)] * 2
    assert all(r["fused"] > 0 and r["composed"] > 0 for r in rows)
    q, k = mx.random.normal((1, 6, 5, 64)).astype(mx.float16), mx.random.normal((1, 2, 37, 64)).astype(mx.float16)
    mask = mx.where(mx.random.uniform(shape=(5, 37)) > 0.3, 0.0, -1e4).astype(mx.float16)
    want = mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125, mask=mask)
    assert mx.array_equal(composed_attention(q, k, k, mask, 0.125), want).item()


def test_sampled_loop_checks_tokens_against_plain_sampled_decoding(tmp_path, capsys):
    # --temp: every arm samples (mlx-plain with mlx-lm's sampler, the speed baseline only); the
    # loop adds this library's plain sampled decoding (`plain`) and checks every arm's tokens
    # against it; ARM/uncoupled drafts argmaxes where the library's drafter guesses the draw
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from run import Arms, load_target, main

    from mlx_treespec.sampling import Draw, make_node_sampler

    main(["loop", "--target", "demo", "--temp", "0.7", "--seed", "3", "--arms",
          "eagle3-chain:2,eagle3-tree:2:2:4:1/uncoupled", "--prompts", *short_prompts(tmp_path, "unseen"), "--n", "1",
          "--max-tokens", "6",
          "--out", str(tmp_path / "loop")])
    data = read_json(tmp_path / "loop.json.gz")
    assert (data["meta"]["temp"], data["meta"]["seed"]) == (0.7, 3)
    (rows,) = [{r["arm"]: r for r in s["arms"]} for s in data["sets"].values()]
    assert list(rows) == ["mlx-plain", "plain", "eagle3-chain:2", "eagle3-tree:2:2:4:1/uncoupled"]
    assert all(rows[a]["identical"] == "1/1" for a in ("plain", "eagle3-chain:2", "eagle3-tree:2:2:4:1/uncoupled"))
    assert "(1 x 6 tokens, 1 runs an arm, temp 0.7)" in (tmp_path / "loop.md").read_text()
    capsys.readouterr()
    main(["table", "--from", str(tmp_path / "loop.json.gz")])
    assert "temp 0.7" in capsys.readouterr().out
    target, _ = load_target("demo")
    arms = Arms(target, "demo", [])
    coupled, uncoupled = arms.maker("eagle3-chain:2")(), arms.maker("eagle3-chain:2/uncoupled")()
    draw = Draw(make_node_sampler(0.7))
    coupled.draw = uncoupled.draw = draw
    assert coupled.draw is draw and uncoupled.draw is None
    with pytest.raises(ValueError, match="ARM/uncoupled takes"):
        arms.maker("lookup:8:4/uncoupled")()
    # wrapper suffixes combine (each binds the maker it wraps), and an adaptive A/B arm learns
    # apart from the arm it varies
    auto, both = arms.maker("auto:eagle3")(), arms.maker("auto:eagle3/uncoupled/chains")()
    argmaxes, chains = arms.maker("auto:eagle3/uncoupled")(), arms.maker("auto:eagle3/chains")()
    both.draw = draw
    assert both.draw is None and not both.queues_trees and isinstance(both.primary, type(auto.primary))
    held, handing = arms.maker("auto:eagle3")(), arms.maker("auto:eagle3/chains/handback")()
    held.draw = handing.draw = draw
    assert held.holds_queue and not handing.holds_queue and not handing.queues_trees
    assert len({id(d.learned) for d in (auto, both, argmaxes, chains, handing)}) == 5
    for arm in ("eagle3-chain:2/handback", "auto:lookup/handback"):
        with pytest.raises(ValueError, match="ARM/handback takes"):
            arms.maker(arm)()
    with pytest.raises(ValueError, match="ARM/handback judges queued rounds"):
        arms.maker("auto:eagle3/sync/handback")


def test_stalls_section_tiny(tmp_path):
    # rounds over the stall line per generation, two passes in one process, then the first and
    # second call of masked attention and of a depthwise conv1d at shapes new to the process;
    # the table holds a row per arm and pass and one per timed shape
    run(["stalls", "--target", "demo", "--arms", "eagle3-chain:2/sync", "--prompts", *short_prompts(tmp_path, "unseen"), "--n", "1",
         "--max-tokens", "8", "--reps", "2", "--out", str(tmp_path / "s")])
    report = read_json(tmp_path / "s.json.gz")
    assert [(r["arm"], r["rep"], r["prompt"]) for r in report["runs"]] == [("eagle3-chain:2/sync", 0, 0),
                                                                          ("eagle3-chain:2/sync", 1, 0)]
    for r in report["runs"]:
        assert r["rounds"] > 0 and r["wall_s"] > 0 and all(ms > 50 for ms, _ in r["slow"])
        assert r["slow_ms"] == pytest.approx(sum(ms for ms, _ in r["slow"]))
    firsts = report["firsts"]
    assert [(f["kind"], f["rows"]) for f in firsts] == (
        [("attention", R) for W in (640, 1152, 1664) for R in (2, 4, 8, 16)] + [("conv1d", R) for R in (2, 4, 8, 16, 32)])
    assert all(f["first_ms"] > 0 and f["second_ms"] > 0 for f in firsts)
    md = (tmp_path / "s.md").read_text().splitlines()
    assert sum(line.startswith("| eagle3-chain:2/sync |") for line in md) == 2
    assert sum(line.startswith(("| attention |", "| conv1d |")) for line in md) == 17
