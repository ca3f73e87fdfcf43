"""mlx-lm-style library calls: `stream_generate` and `generate`, speculating with a draft tree.

    from mlx_treespec import stream_generate, generate

`python -m mlx_treespec.generate` is the command line (mlx_treespec/cli.py).
"""
import os
import time
from contextlib import closing

import mlx.core as mx

from ..draft import check_drafter
from ..loop import RoundStats, check_prompt, check_stop_tokens, tree_generate_step, vocab_size
from ..spec import DraftSpec, check_int

__all__ = ["stream_generate", "generate", "make_drafter", "check_vocab"]


def check_vocab(model, draft_model):
    """Refuse a draft model with more output rows than the target has embeddings, naming the fix.

    Fewer is fine: checkpoints of one tokenizer pad their embeddings to different sizes (a
    Qwen2.5-0.5B's 151,936 rows drafting for a 7B's 152,064), and every id the draft proposes
    is one the target embeds; the sampled draw's noise is a function of the id, so a draft
    guesses the target's draw over its own ids (sampling.position_uniform). More would propose
    ids the target has no row for. The tokenizers themselves are the caller's to match (the CLI
    compares them, as mlx-lm's does)."""
    vt, vd = vocab_size(model), vocab_size(draft_model)
    if vt is not None and vd is not None and vd > vt:
        raise ValueError(
            f"the draft model's vocabulary ({vd} tokens) is larger than the target's ({vt}): it would "
            "propose ids the target has no row for: use a drafter trained with the target's tokenizer"
        )


def check_draft_model_kind(drafter, draft_model):
    """Refuse a draft model of the wrong kind for `drafter` ('model': a loaded mlx-lm model;
    'dflash', 'mtp', 'eagle3': a folder or that kind's module), naming what goes there."""
    import mlx.nn as nn

    from ..drafters.dflash import BoundDFlash, DFlashModel
    from ..drafters.mtp import HeadModule

    if draft_model is None:
        return
    if isinstance(draft_model, (bool, int, float)):  # (mlx-lm's 4th positional: max_tokens, or verbose)
        raise ValueError(f"the 4th argument is the draft model here, got {draft_model!r}: pass max_tokens= "
                         "and verbose= by name (mlx-lm's stream_generate and generate take them there)")
    folder = isinstance(draft_model, (str, os.PathLike))
    got = f"a folder path ({os.fspath(draft_model)})" if folder else type(draft_model).__name__
    if drafter == "model" and (folder or not isinstance(draft_model, nn.Module)
                               or isinstance(draft_model, (DFlashModel, HeadModule))):
        raise ValueError(f"drafter='model' takes a loaded mlx-lm model (mlx_lm.load(path)[0]), got {got}: "
                         "a DFlash folder goes with drafter='dflash', a head's with drafter='mtp' or 'eagle3'")
    if drafter == "dflash" and not (folder or isinstance(draft_model, (DFlashModel, BoundDFlash))):
        raise ValueError(f"drafter='dflash' takes a DFlash drafter's folder (or its DFlashModel), got {got}: "
                         "a draft model goes with drafter='model'")
    if drafter in ("mtp", "eagle3") and not (folder or isinstance(draft_model, HeadModule)):
        what = "the target's own folder (its mtp.* weights)" if drafter == "mtp" else "an EAGLE-3 head's folder"
        raise ValueError(f"drafter={drafter!r} takes {what} (or its loaded head), got {got}: "
                         "a draft model goes with drafter='model'")


def loaded(folder, target, kind, load):
    """`load(folder, target)` (a head or a bound DFlash drafter), kept on `target`, one folder
    per kind: a library call makes a drafter per generation, and one given a folder read its
    weights and traced its compiled drafts again each call. Read again where the folder's
    weight, config and ranking files changed (name, size, inode, times) or the target's
    embedding, lm_head or layer count did (a quantized or adapted target: the head binds
    them); another folder of the kind replaces it. It lives as long as the target."""
    path = os.path.realpath(str(folder))
    try:
        files = [(e.name, e.stat()) for e in os.scandir(path)
                 if e.is_file() and e.name.endswith((".safetensors", ".json"))]
    except OSError:  # (not a folder: the loader names the fix)
        return load(str(folder), target)
    attributes = getattr(target, "__dict__", None)
    if attributes is None:
        return load(str(folder), target)
    from ..drafters import target_io, text_model

    # what the loaded model binds, by identity (target_io's lm_head of a tied target is a new
    # bound method each call: its module is the embedding's)
    binds = (target_io(target)[1], getattr(text_model(target), "lm_head", None))
    stamp = (path, sorted((name, st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns) for name, st in files),
             len(getattr(target, "layers", ())))
    store = attributes.setdefault("_treespec_loaded", {})
    hit = store.get(kind)
    if hit is None or hit[0] != stamp or any(a is not b for a, b in zip(hit[1], binds)):
        store.pop(kind, None)  # (the old one goes before the new one is read)
        hit = store[kind] = (stamp, binds, load(str(folder), target))
    return hit[2]


def make_drafter(draft_model=None, *, drafter=None, target=None, **options):
    """The drafter for mlx-lm-style options (`draft_block_size`, `tree_topk`, `tree_depth`,
    `tree_budget`, `tree_lanes`, `draft_lookup`, `draft_lookup_trust`, `draft_vocab`; see
    DraftSpec).

    With no shape option the drafter is adaptive (mlx_treespec.adaptive): each round picks
    between the kind's default shape, prompt lookup and no draft, priced with `target`'s
    start-up costs. `drafter` is a drafter object (used as it is, with no shape option) or a
    kind: 'model' (the default with a draft model), 'lookup', 'suffix', 'dflash' (a DFlash folder as
    `draft_model`, bound to `target`), 'mtp' (the target's own folder as `draft_model`: its
    mtp.* weights), 'eagle3' (an EAGLE-3 folder), 'none'. No drafter and no draft model: None
    (plain decoding)."""
    if drafter is not None and not isinstance(drafter, str):
        given = [k for k, v in options.items() if v is not None]
        if options.get("draft_lookup"):
            raise ValueError("--draft-lookup adds lookup nodes to a draft model's tree: use it with "
                             "--draft-model, not --drafter")
        if given:
            raise ValueError(f"drafter= is a drafter object: its shape is its own; drop {', '.join(given)} "
                             "(or pass drafter='model' with a draft model)")
        if draft_model is not None:
            raise ValueError(f"drafter= is a drafter object ({type(drafter).__name__}): it drafts with its "
                             "own model; drop the draft model")
        return check_drafter(drafter)
    spec = DraftSpec.from_options(drafter, has_draft_model=draft_model is not None, **options)
    if draft_model is not None and not spec.needs_draft_model:
        raise ValueError(f"drafter={spec.drafter!r} drafts without a model: drop the draft model")
    spec.check_draft_model(draft_model)  # (before a DFlash or head folder is read)
    check_draft_model_kind(spec.drafter, draft_model)
    if spec.drafter == "dflash":
        from ..drafters.dflash import BoundDFlash, bind_dflash

        if isinstance(draft_model, BoundDFlash):  # (bound before: bound again, to this target)
            draft_model = draft_model.model
        draft_model = loaded(draft_model, target, "dflash", bind_dflash) \
            if isinstance(draft_model, (str, os.PathLike)) and target is not None else bind_dflash(draft_model, target)
    elif spec.drafter in ("mtp", "eagle3") and isinstance(draft_model, (str, os.PathLike)):
        if target is None:
            raise ValueError(f"a {spec.drafter} head reads the target's hidden states: pass target=")
        from ..drafters.eagle3 import load_eagle3
        from ..drafters.mtp import load_mtp

        draft_model = loaded(draft_model, target, spec.drafter, load_mtp if spec.drafter == "mtp" else load_eagle3)
    elif spec.drafter == "model" and target is not None and draft_model is not None:
        check_vocab(target, draft_model)
    return spec.build(draft_model, target=target)


def stream_generate(model, tokenizer, prompt, draft_model=None, *, max_tokens=256, drafter=None,
                    draft_block_size=None, tree_topk=None, tree_depth=None, tree_budget=None,
                    tree_lanes=None, draft_lookup=None, draft_lookup_trust=None, draft_vocab=None,
                    stats=None, sampler=None, **kwargs):
    """mlx-lm's `stream_generate`, speculating with a draft tree. Yields `GenerationResponse`s.

    Sampling options are `temp`, `top_p`, `min_p`, `top_k`, `seed` (not a `sampler` function:
    the draw at each node must be a function of its position for trees to stay exact). A prompt
    cache passed in holds the prompt and every token delivered when the stream ends or is
    abandoned, as mlx-lm's does.
    """
    from mlx_lm.generate import GenerationResponse
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if sampler is not None:
        raise ValueError("pass temp=, top_p=, min_p=, top_k=, seed= instead of a sampler function")
    if kwargs.get("logits_processors"):
        raise ValueError("logits_processors= would change the target's tokens after its verify: a tree "
                         "cannot stay exact under them; drop them (or decode with mlx_lm.generate)")
    kwargs.pop("logits_processors", None)
    if "num_draft_tokens" in kwargs:  # (mlx-lm's name for a chain's length; ignored, as there, where nothing drafts)
        n = kwargs.pop("num_draft_tokens")
        if draft_model is None and drafter is None:
            n = None
        if draft_block_size is not None and n is not None and n != draft_block_size:
            raise ValueError("give num_draft_tokens= or draft_block_size= (the same option), not both")
        draft_block_size = n if draft_block_size is None else draft_block_size
    max_tokens = check_int(max_tokens, "max_tokens")
    if max_tokens == 0:
        raise ValueError("max_tokens must be non-zero (use -1 for no limit)")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        add_special = tokenizer.bos_token is None or not prompt.startswith(tokenizer.bos_token)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    prompt = check_prompt(prompt, vocab_size(model))
    drafter = make_drafter(draft_model, drafter=drafter, target=model, draft_block_size=draft_block_size,
                           tree_topk=tree_topk, tree_depth=tree_depth, tree_budget=tree_budget,
                           tree_lanes=tree_lanes, draft_lookup=draft_lookup,
                           draft_lookup_trust=draft_lookup_trust, draft_vocab=draft_vocab)
    stats = stats if stats is not None else RoundStats()
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    # the caller's stop tokens beside the tokenizer's
    eos = set(tokenizer.eos_token_ids) | check_stop_tokens(kwargs.pop("stop_tokens", ()), vocab_size(model))
    steps = tree_generate_step(prompt, model, drafter, max_tokens=max_tokens, stop_tokens=eos,
                               stats=stats, **kwargs)
    tic = time.perf_counter()
    prompt_tps, n, token, logprobs, from_draft = 0.0, -1, None, None, False

    def response(finish_reason):
        return GenerationResponse(
            text=detokenizer.last_segment, token=token, logprobs=logprobs, from_draft=from_draft,
            prompt_tokens=len(prompt), prompt_tps=prompt_tps, generation_tokens=n + 1,
            generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish_reason,
        )

    # mlx-lm's loop: a response per token as it comes; the last one (an EOS, or the
    # max_tokens-th) after the detokenizer's last segment, with its finish reason
    with closing(steps):
        for n, (token, logprobs, from_draft) in enumerate(steps):
            if n == 0:
                prompt_tps = len(prompt) / max(time.perf_counter() - tic, 1e-9)
                tic = time.perf_counter()
            if token in eos:
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield response(None)
    # the steps are closed here: a prompt cache holds every delivered token
    detokenizer.finalize()
    if n >= 0:
        yield response("stop" if token in eos else "length")


def generate(model, tokenizer, prompt, draft_model=None, verbose=False, **kwargs):
    """Generate a complete response; with `verbose`, print it as mlx-lm's generate does."""
    import itertools

    responses = stream_generate(model, tokenizer, prompt, draft_model, **kwargs)
    first = next(responses, None)  # bad input raises here, before anything is printed
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in itertools.chain([first] if first is not None else [], responses):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if len(text) == 0:
            print("No text generated for this prompt")
            return text
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
