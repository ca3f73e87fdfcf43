"""The H200 benchmark scripts run end to end (tiny settings, CPU), so a device call never meets a
broken script; on CPU every arm's tokens equal plain decoding's."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args, tmp_path):
    out = subprocess.run([sys.executable] + args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_bench_loop_quick(tmp_path):
    path = tmp_path / "loop.json"
    text = run(["bench/bench_loop.py", "--quick", "--out", str(path)], tmp_path)
    assert "## Verify loop" in text and "Bars: ours chain" in text
    data = json.loads(path.read_text())
    assert data["best_chain"].startswith("ours chain") and "+" not in data["best_chain"]
    tree_arms = [n for n in data["arms"] if n.startswith("ours tree") or "+ lookup" in n]
    assert data["fastest_tree"] in tree_arms and data["widest_tree"] in tree_arms
    assert any("trust 3" in n for n in tree_arms) and "lookup chain 4 (no draft model)" in data["arms"]
    assert set(data["overhead"]) >= {data["best_chain"], data["fastest_tree"]}
    for name, arm in data["arms"].items():  # CPU verifies are bitwise: no arm ever diverges
        assert all(d is None for d in arm["first_divergence"]), name


def test_round_parts_bench_tiny(tmp_path):
    path = tmp_path / "parts.json"
    run(["bench/round_parts_bench.py", "--reps", "1", "--history", "32", "--loop-prompts", "1",
         "--loop-tokens", "24", "--out", str(path)], tmp_path)
    data = json.loads(path.read_text())
    timed = [v for k, v in data.items() if not k.startswith("loop, ")]
    loops = [v for k, v in data.items() if k.startswith("loop, ")]
    assert len(timed) >= 20 and all(v["synced_ms"] > 0 for v in timed)
    assert len(loops) == 6 and all(v["tok_s"] > 0 for v in loops)


def test_branch_scripts_tiny(tmp_path):
    text = run(["bench/branch_profile.py", "--tokens", "16", "--reps", "1"], tmp_path)
    assert text.count("draft()") == 5 and "with a .item() each" in text
    text = run(["bench/branch_diag.py", "--prompts", "1", "--tokens", "16"], tmp_path)
    assert "batch step R=2 history 600" in text and "R3 P=1.0" in text
    text = run(["bench/branch_acceptance.py", "--prompts", "1", "--tokens", "8"], tmp_path)
    assert text.count("= plain 1/1") == 15


def test_round_split_and_merged_scripts_tiny(tmp_path):
    # the scripts behind RESULTS sections 1b and 1c, at sizes CI affords
    text = run(["bench/round_split.py", "--prompts", "1", "--tokens", "12", "--arms", "chain k=6,rows K3 S8 R3"], tmp_path)
    assert text.count("| chain k=6 |") == 1 and text.count("| rows K3 S8 R3 |") == 1
    text = run(["bench/branch_host.py", "--prompts", "1", "--tokens", "12"], tmp_path)
    assert text.count("draft() total") == 3
    text = run(["bench/batch_row_ops.py", "--reps", "2"], tmp_path)
    assert "| drafter step (B-row cache) |" in text and "| sdpa T=1, batch rows folded into heads |" in text
    text = run(["bench/merged_acceptance.py", "--prompts", "1", "--tokens", "12", "--lookup", "4"], tmp_path)
    assert text.count("= plain 1/1") == 10 and "trust 3" in text
