# temporary diagnostic (not committed): why the adaptive default leaves queued rounds when sampling
import sys, itertools
sys.path.insert(0, "bench")
import run as R
import mlx_treespec.adaptive as A
from mlx_treespec.harness import generate_once

temp = float(sys.argv[1]); target_name = sys.argv[2]; arm = sys.argv[3]
target, tok = R.load_target(target_name)
texts = R.load_prompts("unseen")[:4]
prompts = R.encode_prompts(tok, texts)
arms = R.Arms(target, target_name, texts, None, None, dict(mtp=None, eagle3=None), dict(temp=temp, seed=0))
make = arms.maker(arm)
orig = A.AdaptiveDrafter.queue_more
log = []
def qm(self, tokens, ms):
    ok = orig(self, tokens, ms)
    booked = self.queued
    rate = sum(t for t, _ in booked) / max(sum(m for _, m in booked), 1e-6) if booked else None
    fit = 1.0 / float(self.costs[0]) if self.costs is not None and not callable(self.costs) else None
    host = self.shadow_total[0] / max(self.shadow_total[1], 1e-6) if self.shadow_total[0] else None
    if not ok:
        log.append(f"hand back: booked {len(booked)} rate {rate:.3f} tok/ms, plain fit {fit}, host shadow {host}")
    return ok
A.AdaptiveDrafter.queue_more = qm
for i, p in enumerate(prompts):
    for rep in range(2 if i == 0 else 1):
        log.clear()
        d = make()
        out, stats, dt = generate_once(target, d, p, 192, temp=temp, seed=0)
        runs = [(k, len(list(g))) for k, g in itertools.groupby(stats.drafter)]
        print(f"prompt {i} rep {rep}: {len(out)/dt:.1f} tok/s plain_ms_fit={d.costs[0] if d.costs and not callable(d.costs) else None}")
        print("  rounds:", " ".join(f"{k}x{n}" for k, n in runs))
        for l in log[:6]:
            print("  ", l)
