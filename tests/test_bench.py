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
    assert data["best_chain"].startswith("ours chain") and data["fastest_tree"].startswith("ours tree")
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
