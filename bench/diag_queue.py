"""Diagnostic (not part of the harness): every decision of the adaptive default's queued rounds
when sampling. `python bench/diag_queue.py TEMP TARGET ARM N`: N unseen prompts (the first
twice), 192 tokens each; per generation its rounds by drafter and each queued round's emitted
tokens, ms and the booked window's rate (tokens / ms)."""
import itertools
import sys

sys.path.insert(0, "bench")
import run as R  # noqa: E402

import mlx_treespec.adaptive as A  # noqa: E402
from mlx_treespec.harness import generate_once  # noqa: E402

temp, target_name, arm, n = float(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
target, tok = R.load_target(target_name)
texts = R.load_prompts("unseen")[:n]
prompts = R.encode_prompts(tok, texts)
arms = R.Arms(target, target_name, texts, None, None, dict(mtp=None, eagle3=None), dict(temp=temp, seed=0))
make = arms.maker(arm)
queue_more, log = A.AdaptiveDrafter.queue_more, []


def logged(self, tokens, ms):
    ok = queue_more(self, tokens, ms)
    booked = self.queued
    rate = sum(t for t, _ in booked) / max(sum(m for _, m in booked), 1e-6) if booked else 0
    log.append(f"{'Q' if ok else 'BACK'} t={len(tokens)} ms={ms:.2f} seen={self.queued_seen} booked={len(booked)} "
               f"rate={rate:.3f}")
    return ok


A.AdaptiveDrafter.queue_more = logged
for i, p in enumerate(prompts):
    for rep in range(2 if i == 0 else 1):
        log.clear()
        d = make()
        out, stats, dt = generate_once(target, d, p, 192, temp=temp, seed=0)
        print(f"prompt {i} rep {rep}: {len(out) / dt:.1f} tok/s plain_ms_fit={d.costs[0]}")
        print("  rounds:", " ".join(f"{k}x{len(list(g))}" for k, g in itertools.groupby(stats.drafter)))
        for line in log[:60]:
            print("  ", line)
