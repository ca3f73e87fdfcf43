"""The sweep CLI end to end (table, JSON, PNG, bar line), the cost model and its projections.

Runs on tiny random models written as mlx-lm folders with a character tokenizer; each test
prints which pair ran (pytest -s shows it; the JSON's meta.model says it too).
"""
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tiny
import mlx_treespec
from mlx_treespec import costmodel, sweep
from mlx_treespec.spec import DraftSpec
from mlx_treespec.sweep import Arm, compute_bar, grid_arms, parse_arm
from mlx_treespec.tree import MAX_NODES

DEMO = Path(mlx_treespec.__file__).parent / "demo"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ARM_KEYS = {"name", "kind", "shape", "series", "params", "requested_nodes", "probe", "runs", "median",
            "spread", "same_as_plain"}
RUN_KEYS = {"prompt", "order", "tokens", "tok_s", "acceptance", "emitted_per_verify", "nodes_per_round",
            "draft_ms_per_round", "verify_ms_per_round", "round_ms", "requested_budget",
            "effective_budget", "requested_depth", "effective_depth", "ratio_vs_plain", "same_as_plain"}


def _char_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = ["\n"] + [chr(c) for c in range(32, 126)]  # 95 characters + <|endoftext|> = tiny.VOCAB
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    assert len(vocab) == tiny.VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target folder, drafter folder, which): tiny models written as mlx-lm folders (the demo
    pair's 8-bit drafter made a sweep take ~50 s on this CPU; the demo pair's own sweep is
    tests/test_cli.py's and bench/run.py's business)."""
    from mlx_lm.utils import save_config, save_model

    root = tmp_path_factory.mktemp("tiny_pair")
    cfg = dict(tiny.CONFIGS["qwen3"])
    target = tiny.build(cfg)
    drafter = tiny.perturbed(target)
    for name, model in (("target", target), ("drafter", drafter)):
        save_model(root / name, model)
        save_config(dict(cfg), root / name / "config.json")
        _char_tokenizer(root / name)
    return str(root / "target"), str(root / "drafter"), "tiny qwen3 pair"


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.json"
    p.write_text(json.dumps(sweep.BUILTIN_PROMPTS[:2]))
    return p


def test_sweep_end_to_end(pair, prompts_file, tmp_path, capsys):
    """One CLI sweep (2 prompts, plain + chain of 2, with the cost model), then what it wrote,
    its cost model and a projection from its acceptance: one test, so one sweep a run (a module
    fixture ran once per xdist worker)."""
    target, drafter, which = pair
    out = tmp_path / "sweep"
    argv = ["--model", target, "--draft-model", drafter, "--prompts", str(prompts_file),
            "--max-tokens", "12", "--blocks", "2", "--tree-topk", "none", "--out", str(out),
            "--warmup-tokens", "8", "--probe-inputs", "2", "--no-progress", "--cost-model",
            "--cost-history", "32", "--cost-repeats", "2"]
    t0 = time.perf_counter()
    doc = sweep.main(argv)
    swept = dict(out=out, stdout=capsys.readouterr().out, doc=doc)
    print(f"sweep ran on the {which} in {time.perf_counter() - t0:.1f} s")
    _table_json_png_and_bar(swept)
    _cost_model_on_the_pair(swept)
    _projection_from_config_is_labelled(swept, tmp_path, capsys)


def _table_json_png_and_bar(swept):
    out, stdout = swept["out"], swept["stdout"]
    # table on stdout and in sweep.md
    table = (out / "sweep.md").read_text()
    for text in (stdout, table):
        assert "| arm | shape | budget req/eff | depth req/eff |" in text
        assert "| plain | plain decode |" in text and "| chain2 | chain k=2 |" in text
        assert "bar: a tree of 3 nodes must emit > " in text
        assert "best chain: k=2" in text
    # JSON: every arm with its raw per-prompt figures
    doc = json.loads((out / "sweep.json").read_text())
    assert [a["name"] for a in doc["arms"]] == ["plain", "chain2"]
    assert doc["meta"]["num_prompts"] == 2 and doc["meta"]["device"] == "cpu"
    for arm in doc["arms"]:
        assert ARM_KEYS <= set(arm), ARM_KEYS - set(arm)
        assert len(arm["runs"]) == 2
        for run in arm["runs"]:
            assert RUN_KEYS <= set(run), RUN_KEYS - set(run)
            assert run["tokens"] > 0 and run["tok_s"] > 0
            assert run["same_as_plain"] is True  # greedy speculation is exact on CPU
        assert arm["probe"]["flips"] == 0 and arm["probe"]["max_abs_diff"] == 0.0
        assert {"median", "min", "max", "q1", "q3"} <= set(arm["spread"]["tok_s"])
    plain, chain = doc["arms"]
    assert plain["median"]["acceptance"] is None and plain["median"]["ratio_vs_plain"] == 1.0
    assert chain["median"]["requested_budget"] == 2 and chain["median"]["requested_depth"] == 2
    assert 0 <= chain["median"]["acceptance"] <= 1
    assert 1 <= chain["median"]["emitted_per_verify"] <= 3
    assert chain["probe"]["nodes"] == 3 and chain["probe"]["shape"] == "chain"
    # the order rotates with the prompt
    assert [r["order"] for r in plain["runs"]] == [0, 1]
    assert doc["bar"]["best_chain"] == "chain2" and "line" in doc["bar"]
    # PNG
    png = out / "sweep.png"
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000
    import matplotlib.image

    assert matplotlib.image.imread(str(png)).shape[0] > 100


def _cost_model_on_the_pair(swept):
    pair = swept["doc"]["cost_model"]["pair"]
    v = costmodel.CostFit.from_dict(pair["verify"])
    assert sorted(v.points) == list(costmodel.VERIFY_TS)
    assert 0 <= v.linear_max_rel_err and v(1) == v.t1 > 0
    assert sorted(costmodel.CostFit.from_dict(pair["draft"]).points) == list(costmodel.DRAFT_LANES)
    names = [a["name"] for a in pair["arms"]]
    assert names == ["plain", "chain2"]
    for a in pair["arms"]:
        assert a["model_tok_s"] > 0 and a["overhead_ms"] >= 0
    assert "tok/s (cost model)" in swept["stdout"]
    assert "cost model (measured pair): verify t(1)=" in swept["stdout"]


def _projection_from_config_is_labelled(swept, tmp_path, capsys):
    cfg = tmp_path / "tiny_qwen3.json"
    cfg.write_text(json.dumps(dict(tiny.CONFIGS["qwen3"], num_hidden_layers=3)))
    dcfg = tmp_path / "tiny_draft.json"
    dcfg.write_text(json.dumps(dict(tiny.CONFIGS["qwen3"], num_hidden_layers=1)))
    out = tmp_path / "proj"
    doc = sweep.main(["--acceptance-from", str(swept["out"] / "sweep.json"), "--cost-model-config",
                      str(cfg), "--cost-model-draft-config", str(dcfg), "--dtype", "bfloat16",
                      "--q-bits", "0,4", "--q-group-size", "32", "--cost-history", "16",
                      "--cost-repeats", "2", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert "tok/s (projection)" in stdout and "### projection: tiny_qwen3 bfloat16" in stdout
    assert "4-bit (group 32)" in stdout
    assert "bar (projection, " in stdout
    saved = json.loads((out / "projection.json").read_text())
    projs = saved["cost_model"]["projections"]
    assert [p["q_bits"] for p in projs] == [None, 4]
    for p in projs:
        assert p["label"] == "projection"
        assert p["draft"].startswith("tiny_draft")
        costmodel.CostFit.from_dict(p["verify"])
        for arm in p["arms"]:
            assert arm["projection_tok_s"] > 0 and arm["projection_round_ms"] > 0
            assert all(k.startswith("projection") for k in arm if "tok_s" in k or "round_ms" in k)
    # the 4-bit target is a different model: its verify curve is its own
    assert projs[0]["verify"]["points"] != projs[1]["verify"]["points"]
    assert "projection" in (out / "projection.md").read_text()
    assert doc["cost_model"]["projections"] is projs or doc["cost_model"]["projections"]


def test_fit_curve():
    line = costmodel.fit_curve({1: 2.0, 2: 3.0, 4: 3.4, 8: 4.2, 16: 5.8})
    assert line.kind == "linear" and line.linear_max_rel_err < 1e-9
    assert abs(line(32) - (2.6 + 0.2 * 32)) < 1e-9 and line(1) == 2.0
    bent = costmodel.fit_curve({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 4.0, 64: 12.0})
    assert bent.kind == "interp" and bent.linear_max_rel_err > 0.1
    assert bent(16) == 1.0 and bent(48) == 8.0 and bent(64) == 12.0
    assert bent(128) == 12.0 + 8.0 / 32 * 64  # past the last point: its segment's slope
    # an array of T at once (an adaptive drafter's verify table): t(1) up to 1, then the line,
    # or the points joined and the last segment's slope past them
    Ts = np.array([0.0, 1.0, 1.5, 2.0, 3.0, 31.0, 48.5, 64.0, 65.0, 257.0])
    np.testing.assert_allclose(line.at(Ts), [2.0, 2.0] + [2.6 + 0.2 * T for T in Ts[2:]], rtol=1e-12)
    np.testing.assert_allclose(bent.at(Ts), [1.0] * 5 + [1.0 + 3.0 * 15 / 16, 4.0 + 8.0 * 16.5 / 32, 12.0,
                                                         12.25, 12.0 + 0.25 * 193], rtol=1e-12)


def test_bar_formula():
    rows = [dict(name="plain", kind="plain", block=0, budget=0, nodes=1, E=1.0, R=10.0, tok_s=100,
                 draft_ms=0, verify_ms=10),
            dict(name="chain4", kind="chain", block=4, budget=4, nodes=5, E=3.0, R=20.0, tok_s=150,
                 draft_ms=8, verify_ms=12),
            dict(name="tree-a", kind="tree", block=0, budget=4, nodes=5, E=3.4, R=24.0, tok_s=141,
                 draft_ms=11, verify_ms=13),
            dict(name="tree-b", kind="tree", block=0, budget=4, nodes=5, E=3.5, R=22.0, tok_s=159,
                 draft_ms=9, verify_ms=13)]
    text, info = compute_bar(rows)
    # bar = E_chain * R_tree / R_chain with the best tree of the chain's node count
    assert info["best_tree"] == "tree-b" and info["bar"] == pytest.approx(3.0 * 22.0 / 20.0)
    assert info["wins"] is True
    assert text.startswith("bar: a tree of 5 nodes must emit > 3.300 per verify "
                           "(best chain: k=4, E=3.000, R=20.00 ms); best tree: tree-b")
    assert text.endswith("emits 3.500 -> wins")
    rows[3].update(E=3.2, tok_s=145)
    text, info = compute_bar(rows)
    assert info["best_tree"] == "tree-b" and text.endswith("-> loses")


def test_arms_grid_and_specs():
    arms = grid_arms((1, 2, 4, 8), (2, 4))
    names = [a.name for a in arms]
    assert names[:5] == ["plain", "chain1", "chain2", "chain4", "chain8"]
    trees = [a for a in arms if a.kind == "tree"]
    assert {a.budget for a in trees} == {2, 4, 8}  # budgets matched to the blocks (1 is the chain)
    for a in trees:
        assert a.depth <= a.budget <= a.topk + (a.depth - 1) * a.topk ** 2
        assert a.requested_nodes == a.budget + 1
    assert parse_arm("chain:4") == parse_arm("chain4") == Arm(DraftSpec("model", topk=1, lanes=1, depth=4, budget=4))
    assert parse_arm("tree:2:4:8") == Arm(DraftSpec("model", topk=2, lanes=2, depth=4, budget=8))
    assert parse_arm("tree:2:4:8:2") == parse_arm("tree:2:4:8")  # lanes = K
    one_lane = parse_arm("tree:4:8:16:1")
    assert one_lane.name == "tree-k4-l1-d8-b16" and one_lane.shape == "tree K=4 L=1 S=8 B=16"
    assert one_lane.params()["lanes"] == 1 and parse_arm("tree:2:4:8").params()["lanes"] == 2
    with pytest.raises(SystemExit, match="--tree-lanes"):
        parse_arm("tree:2:4:8:3")
    assert parse_arm("lookup:8:4") == Arm(DraftSpec("lookup", depth=4, budget=8))
    # a chain or tree with a lookup chain under its root is a tree arm
    merged = parse_arm("chain:6+lookup8@3")
    assert merged == Arm(DraftSpec("model", topk=1, lanes=1, depth=6, budget=6, lookup=8, trust=3))
    assert merged.series == "tree + lookup" and merged.requested_nodes == 15 and merged.name == "tree-k1-d6-b6+lu8@3"
    assert len(merged.topology()) == 15 and merged.topology()[7] == 0  # the lookup's first node: a root child
    wide = parse_arm(f"tree:4:8:32:1+lookup{MAX_NODES - 2}")
    assert wide.requested_nodes == MAX_NODES and len(wide.topology()) == MAX_NODES
    for bad in ("chain:6+lookup0", "chain:6+lookup8@5", "lookup:8:4+lookup4", "chain:6+suffix4"):
        with pytest.raises(SystemExit):
            parse_arm(bad)
    with pytest.raises(SystemExit, match="cannot read arm"):
        parse_arm("bogus:1")
    # a head's prefix goes with a chain or tree only (it was dropped: 'mtp-plain' ran plain)
    for bad in ("mtp-plain", "eagle3-lookup:16:8", "mtp-ddtree:31"):
        with pytest.raises(ValueError, match="a head's arm"):
            DraftSpec.parse(bad)
    # DDTree of one node: the block's first argmax, a chain of 1 (it drafted the whole block)
    one = DraftSpec.from_options("dflash", tree_budget=1)
    assert (one.topk, one.depth, one.budget, one.arm) == (1, 1, 1, "dflash:1") and DraftSpec.parse(one.arm) == one


def test_model_free_arms_and_no_matplotlib(monkeypatch, tmp_path, capsys):
    """plain + suffix through run_sweep; without matplotlib: table + JSON only."""
    target = tiny.build(tiny.CONFIGS["qwen3"])
    arms = [parse_arm("plain"), parse_arm("suffix:6:3")]
    rng = np.random.default_rng(0)
    motif = rng.integers(1, tiny.VOCAB, 6).tolist()
    prompts = [motif * 4, (motif[::-1]) * 4]
    result = sweep.run_sweep(target, None, prompts, arms, max_tokens=12, warmup_tokens=4,
                             probe_inputs=1, progress=False)
    assert [a["name"] for a in result["arms"]] == [a.name for a in arms]
    for a in result["arms"]:
        assert all(r["same_as_plain"] for r in a["runs"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert sweep.plot(result, tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_table_and_json_still_written(pair, prompts_file, tmp_path, monkeypatch, capsys):
    target, _, which = pair
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    out = tmp_path / "nompl"
    sweep.main(["--model", target, "--prompts", str(prompts_file), "--num-prompts", "1",
                "--max-tokens", "4", "--blocks", "none", "--tree-topk", "none", "--probe-inputs", "0",
                "--warmup-tokens", "2", "--no-progress", "--out", str(out)])
    stdout = capsys.readouterr().out
    print(f"no-matplotlib sweep ran on the {which}")
    assert "matplotlib is not installed: no plot was written" in stdout
    assert "the table and the JSON were written" in stdout
    assert (out / "sweep.md").exists() and not (out / "sweep.png").exists()
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["outputs"]["plot"] is None and "matplotlib" in doc["outputs"]["plot_missing"]
    assert [a["name"] for a in doc["arms"]] == ["plain"]


def test_merged_lookup_arms_run_exact_as_trees():
    # chain:K+lookupN[@T] and tree:...+lookupN through run_sweep: tree series, exact, probed
    target = tiny.build(tiny.CONFIGS["qwen3"])
    draft = tiny.perturbed(target)
    arms = [parse_arm("plain"), parse_arm("chain:3+lookup4@2"), parse_arm("tree:2:3:6:1+lookup4")]
    motif = np.random.default_rng(1).integers(1, tiny.VOCAB, 6).tolist()
    result = sweep.run_sweep(target, draft, [motif * 4], arms, max_tokens=16, warmup_tokens=4,
                             probe_inputs=1, progress=False)
    for a in result["arms"][1:]:
        assert a["series"] == "tree + lookup" and a["kind"] == "tree" and a["params"]["lookup"] == 4
        assert all(r["same_as_plain"] for r in a["runs"])
        assert a["probe"]["flips"] == 0 and a["probe"]["nodes"] == a["requested_nodes"]
    assert "lookup 4 trust 2" in result["arms"][1]["shape"]
    # the bar compares trees by the draft nodes they verify, the lookup's included
    rows = {r["name"]: r for r in sweep._bar_rows(result)}
    assert rows["tree-k1-d3-b3+lu4@2"]["budget"] == 3 + 4 and rows["tree-k2-l1-d3-b6+lu4"]["budget"] == 6 + 4
    assert sweep._tag(result["arms"][1]) == "K1S3+lu4"
    assert sweep._tag(dict(kind="chain", name="chain6", params=dict(block=6))) == "k6"
