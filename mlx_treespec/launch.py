"""The processes of one `mlx.launch`: a target sharded with mlx.distributed decodes one request,
every process alike.

Every process drafts, verifies, walks and commits the same tree (design.md, "Sharded targets"),
so they must hold the same model (its replicated parts: embedding, final norm, output head, the
config), the same drafter and the same request. A process that differs would send collectives
of other sizes or at other times and leave its peers waiting: `agree` compares digests of all
three once per generation (one all_gather) and raises the same one-line error on every process.
"""
import hashlib
import json

import numpy as np
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

__all__ = ["in_launch", "agree", "shared_seed", "LaunchMismatch"]

_IN_LAUNCH = None
_MARK = 0x7EE5


def in_launch():
    """Whether this process is one of several of an `mlx.launch` (asked once: a process's group
    does not change)."""
    global _IN_LAUNCH
    if _IN_LAUNCH is None:
        _IN_LAUNCH = mx.distributed.is_available() and mx.distributed.init().size() > 1
    return _IN_LAUNCH


class LaunchMismatch(ValueError):
    pass


def _array_digest(h, arrays, split=()):
    """Shapes, dtypes and two integer checksums of each array's bits into the hash `h`: the sum
    of its words and the sum weighted by position, both mod 2^32. Integer sums are exact in any
    order, so machines that reduce in another order agree; any changed element changes them.
    Arrays under a name prefix in `split` (a process's own slice) give their shape and dtype only."""
    for name, a in arrays:
        h.update(f"{name}{tuple(a.shape)}{a.dtype}".encode())
        if a.size == 0 or any(name.startswith(p) for p in split):
            continue
        words = a.reshape(-1).view({1: mx.uint8, 2: mx.uint16}.get(a.dtype.size, mx.uint32)).astype(mx.uint32)
        sums = []
        for start in range(0, words.size, 1 << 24):  # bounded temporaries for a large embedding
            w = words[start: start + (1 << 24)]
            pos = mx.arange(start, start + w.size, dtype=mx.uint32) * 2654435761 + 1  # wraps
            sums += [mx.sum(w), mx.sum(w * pos)]
        h.update(np.array(mx.stack(sums)).astype(np.uint32).tobytes())


def module_digest(module, replicated_only=False):
    """A module's config (`args`) and parameters; with `replicated_only`, the parameters outside
    its decoder layers only (tensor and pipeline sharding split only the layers: what every
    process holds whole). Kept on the module (computed once: a pass over its weights)."""
    key = "_treespec_launch_digest" + ("_replicated" if replicated_only else "")
    cached = module.__dict__.get(key)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    args = getattr(module, "args", None)
    config = vars(args) if args is not None and hasattr(args, "__dict__") else {}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    # mlx.nn's sharded linears hold each process's slice (qwen3_5's untied head split over the
    # vocabulary): their shapes agree, their values do not
    split = tuple(f"{n}." for n, m in module.named_modules() if type(m).__module__ == "mlx.nn.layers.distributed")
    _array_digest(h, [(k, v) for k, v in tree_flatten(module.parameters())
                      if not replicated_only or ".layers." not in f".{k}"], split)
    module.__dict__[key] = out = h.hexdigest()
    return out


def model_digest(model):
    """The target's digest: its replicated parts (`module_digest`)."""
    return module_digest(model, replicated_only=True)


def drafter_digest(drafter, target):
    """The drafter's kind, shape and weights (its own modules; the target's, which a head binds,
    are the model's digest)."""
    h = hashlib.sha256()
    seen = {id(m) for _, m in target.named_modules()}  # what a head binds of the target: the model's digest

    def visit(obj, depth):
        h.update(type(obj).__name__.encode())
        for key, value in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else []:
            if isinstance(value, (bool, int, float, str)) and not key.startswith("_"):
                h.update(f"{key}={value!r};".encode())
            elif isinstance(value, nn.Module) and id(value) not in seen:
                seen.add(id(value))
                h.update(f"{key}:{module_digest(value)};".encode())
            elif depth < 2 and not isinstance(value, (nn.Module, type)) and (
                    callable(getattr(value, "draft", None)) or isinstance(getattr(value, "model", None), nn.Module)):
                visit(value, depth + 1)  # a drafter inside (adaptive, merged) or a bound head

    if drafter is not None:
        visit(drafter, 0)
    return h.hexdigest()


def agree(**fields):
    """Every process of the launch must pass equal `fields` (name -> digest string): one
    all_gather of their 64-bit prefixes; any difference raises LaunchMismatch on every process
    (each sees the same gathered table), naming the fields that differ."""
    group = mx.distributed.init()
    names = sorted(fields)
    # each row: a marker and the rank (a row without them is not a live peer's answer: a
    # collective with a process that left can return unwritten memory), then the digests
    mine = np.concatenate([np.array([_MARK, group.rank()], np.int32),
                           np.array([int(fields[n][:16], 16) for n in names], np.uint64).view(np.int32)])
    table = np.array(mx.distributed.all_gather(mx.array(mine)[None], group=group))
    if table.shape[0] != group.size() or not ((table[:, 0] == _MARK).all()
                                              and (table[:, 1] == np.arange(group.size())).all()):
        raise RuntimeError("a process of this launch did not answer: it stopped or lost its connection")
    table = table[:, 2:]
    differ = [n for i, n in enumerate(names) if not (table[:, 2 * i: 2 * i + 2] == table[0, 2 * i: 2 * i + 2]).all()]
    if differ:
        raise LaunchMismatch(f"the {group.size()} processes of this launch differ in their {', '.join(differ)}: "
                             "run the same command, with the same model and drafter files, on every process")


def shared_seed(seed):
    """A seed every process of the launch uses: rank 0's (each process may have drawn its own)."""
    group = mx.distributed.init()
    mine = int(seed) & 0x7FFFFFFF if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array([mine], mx.int32), group=group).item())
