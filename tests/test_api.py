"""mlx-lm-style library calls on the shipped pair: stream_generate, generate, prompt caches."""
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm import stream_generate as mlx_stream_generate
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import make_prompt_cache

from mlx_treespec.demo import demo_path
from mlx_treespec import RoundStats, generate, stream_generate


@pytest.fixture(scope="module")
def pair():
    target, tokenizer = load(demo_path("target"))
    drafter, _ = load(demo_path("drafter"))
    return target, drafter, tokenizer


def test_stream_generate_yields_mlx_lm_responses_with_the_same_text(pair):
    target, drafter, tok = pair
    ref = list(mlx_stream_generate(target, tok, "def parse(", max_tokens=40))
    stats = RoundStats()
    ours = list(stream_generate(target, tok, "def parse(", drafter, max_tokens=40, tree_topk=3,
                                tree_depth=4, tree_budget=12, stats=stats))
    assert all(isinstance(r, GenerationResponse) for r in ours)
    assert [r.token for r in ours] == [r.token for r in ref]
    assert "".join(r.text for r in ours) == "".join(r.text for r in ref)
    assert ours[-1].finish_reason == ref[-1].finish_reason == "length"
    assert ours[-1].generation_tokens == 40
    assert any(r.from_draft for r in ours) and not all(r.from_draft for r in ours)
    assert stats.rounds < 40  # speculation emitted more than one token per verify
    lp = ours[0].logprobs
    assert lp.shape == (target.args.vocab_size,)
    assert abs(mx.logsumexp(lp).item()) < 1e-3


def test_generate_returns_the_text(pair):
    target, drafter, tok = pair
    text = generate(target, tok, "import os\n", drafter, max_tokens=30, draft_block_size=3)
    ref = "".join(r.text for r in mlx_stream_generate(target, tok, "import os\n", max_tokens=30))
    assert text == ref and len(text) > 0


def test_prompt_cache_continues_a_conversation_like_mlx_lm(pair):
    target, drafter, tok = pair
    turns = ["def parse(", "\n\nclass Config:\n"]
    ours, theirs = make_prompt_cache(target), make_prompt_cache(target)
    for turn in turns:
        a = [r.token for r in stream_generate(target, tok, turn, drafter, max_tokens=24,
                                               draft_block_size=4, prompt_cache=ours)]
        b = [r.token for r in mlx_stream_generate(target, tok, turn, max_tokens=24, prompt_cache=theirs)]
        assert a == b
        assert ours[0].offset == theirs[0].offset


def test_a_sampler_function_is_refused_with_the_fix(pair):
    target, drafter, tok = pair
    with pytest.raises(ValueError, match="temp="):
        list(stream_generate(target, tok, "x", drafter, sampler=lambda x: x))


@pytest.mark.parametrize("kw,needle", [
    (dict(temp=-1.0), "temp"), (dict(temp=float("nan")), "temp"), (dict(top_p=2.0), "top_p"),
    (dict(min_p=-0.5), "min_p"), (dict(temp=1.0, top_k=4096), "top_k"),
    (dict(temp=1.0, min_p=0.5, min_tokens_to_keep=10 ** 5), "min_tokens_to_keep"), (dict(seed=-1), "seed"),
    (dict(seed=1 << 32), "seed"), (dict(kv_bits=8, kv_group_size=7), "kv_group_size"),
])
def test_sampling_and_cache_options_are_checked_before_anything_runs(pair, kw, needle):
    """Out-of-range options are refused naming the option (they once gave wrong tokens or an
    MLX error naming none: a negative temp sampled garbage)."""
    from mlx_treespec import tree_generate_step

    target, drafter, tok = pair
    cache = make_prompt_cache(target)
    with pytest.raises(ValueError, match=needle):
        next(tree_generate_step(tok.encode("def parse("), target, None, max_tokens=4, prompt_cache=cache, **kw))
    assert cache[0].offset == 0  # nothing ran


def test_a_cache_or_drafter_that_does_not_fit_is_refused_before_anything_runs(pair):
    """Another model's cache, a cache of one layer (it once decoded wrong tokens), kv_bits MLX
    cannot quantize to, a max_kv_size beside a cache, a draft model a model-free drafter ignores."""
    from mlx_treespec import make_drafter, tree_generate_step

    target, drafter, tok = pair
    hybrid, _ = load(demo_path("hybrid"))
    prompt = tok.encode("def parse(")
    for cache, kw, needle in ((make_prompt_cache(hybrid), {}, "not this model's"),
                              (make_prompt_cache(target)[:1], {}, "not this model's"),
                              (make_prompt_cache(target), dict(kv_bits=16), "kv_bits"),
                              (make_prompt_cache(target), dict(max_kv_size=64), "drop one")):
        with pytest.raises(ValueError, match=needle):
            next(tree_generate_step(prompt, target, None, max_tokens=4, prompt_cache=cache, **kw))
        assert all(c.offset == 0 for c in cache if hasattr(c, "offset"))
    with pytest.raises(ValueError, match="drop the draft model"):
        make_drafter(drafter, drafter="lookup")


def test_a_draft_model_of_another_kind_is_refused_naming_where_it_goes(pair):
    """A folder path as a draft model, a draft model as a DFlash or head folder, a drafter object
    beside a draft model: one-line errors naming what goes there (they were a TypeError or an
    AttributeError deep inside, or the draft model silently ignored)."""
    from mlx_treespec import make_drafter
    from mlx_treespec.drafters.dflash import bind_dflash

    target, drafter, tok = pair
    for draft_model, kind, needle in ((demo_path("drafter"), None, "mlx_lm.load"),
                                      (demo_path("dflash"), "model", "drafter='dflash'"),
                                      (drafter, "dflash", "DFlash drafter's folder"),
                                      (drafter, "eagle3", "EAGLE-3 head's folder")):
        for build in (lambda: make_drafter(draft_model, drafter=kind, target=target),
                      lambda: next(stream_generate(target, tok, "x", draft_model, drafter=kind, max_tokens=2))):
            with pytest.raises(ValueError, match=needle) as e:
                build()
            assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="drop the draft model"):
        make_drafter(drafter, drafter=make_drafter(drafter, draft_block_size=2))
    for fourth in (100, True):  # mlx-lm's 4th positional (max_tokens, verbose) is the draft model here
        with pytest.raises(ValueError, match="by name"):
            next(stream_generate(target, tok, "x", fourth))
    # a DFlash drafter bound before drafts (bound again to the target it is given)
    bound = bind_dflash(demo_path("dflash"), target)
    ref = [r.token for r in mlx_stream_generate(target, tok, "def parse(", max_tokens=12)]
    assert [r.token for r in stream_generate(target, tok, "def parse(", bound, drafter="dflash",
                                             max_tokens=12)] == ref


def test_mlx_lm_s_num_draft_tokens_is_draft_block_size_and_logits_processors_are_refused(pair):
    target, drafter, tok = pair
    ref = [r.token for r in mlx_stream_generate(target, tok, "def parse(", max_tokens=16)]
    stats = RoundStats()
    out = [r.token for r in stream_generate(target, tok, "def parse(", drafter, max_tokens=16, num_draft_tokens=3,
                                            stats=stats)]
    assert out == ref and max(stats.depth) == 3  # a chain of 3: mlx-lm's meaning
    with pytest.raises(ValueError, match="not both"):
        next(stream_generate(target, tok, "x", drafter, num_draft_tokens=3, draft_block_size=4))
    # nothing drafts: ignored, as mlx-lm ignores it without a draft model
    assert [r.token for r in stream_generate(target, tok, "def parse(", max_tokens=16, num_draft_tokens=3)] == ref
    with pytest.raises(ValueError, match="logits_processors"):
        next(stream_generate(target, tok, "x", drafter, logits_processors=[lambda toks, logits: logits]))


def test_stream_generate_takes_more_stop_tokens(pair):
    target, drafter, tok = pair
    tokens = [r.token for r in stream_generate(target, tok, "def parse(", drafter, max_tokens=12, draft_block_size=3)]
    stop = tokens[5]
    cut = [r.token for r in stream_generate(target, tok, "def parse(", drafter, max_tokens=12, draft_block_size=3,
                                            stop_tokens=[stop])]
    assert cut == tokens[: tokens.index(stop) + 1]


def test_a_tiny_temperature_samples_the_greedy_tokens(pair):
    target, drafter, tok = pair
    greedy = [r.token for r in stream_generate(target, tok, "def parse(", None, max_tokens=12)]
    cold = [r.token for r in stream_generate(target, tok, "def parse(", drafter, max_tokens=12, temp=1e-6,
                                             seed=3, draft_block_size=3)]
    assert cold == greedy  # (float16 log-probabilities over 1e-6 once overflowed to -inf: token 0)


def test_hybrid_demo_target_trees_equal_mlx_lm(pair):
    _, drafter, tok = pair
    hybrid, _ = load(demo_path("hybrid"))
    ref = [r.token for r in mlx_stream_generate(hybrid, tok, "def parse(", max_tokens=48)]
    stats = RoundStats()
    ours = [r.token for r in stream_generate(hybrid, tok, "def parse(", drafter, max_tokens=48,
                                             tree_topk=3, tree_depth=4, tree_budget=12, stats=stats)]
    assert ours == ref
    assert stats.rounds < 48


def test_generate_is_the_function_after_importing_the_submodule():
    # mlx-lm users write `from mlx_treespec import generate`: it must not become a module once
    # something imported mlx_treespec.generate, and `python -m mlx_treespec.generate` stays quiet
    import subprocess
    import sys

    code = ("import mlx_treespec.generate, mlx_treespec.cli\n"
            "from mlx_treespec import generate, stream_generate\n"
            "import mlx_treespec\n"
            "assert callable(generate) and generate.__name__ == 'generate', generate\n"
            "assert mlx_treespec.generate is generate\n"
            "from mlx_treespec.generate import stream_generate as s2\n"
            "assert s2 is stream_generate\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "mlx_treespec.generate", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "RuntimeWarning" not in r.stderr and "--draft-block-size" in r.stdout


@pytest.mark.parametrize("k", [1, 5])
def test_abandoned_stream_generate_leaves_mlx_lm_s_cache(pair, k):
    # a chat UI stops at a stop string: break after k responses. mlx-lm's cache then holds the
    # prompt and k tokens; ours holds the same, and the next turn from it is the same
    target, drafter, tok = pair
    caches = []
    for fn, extra in ((mlx_stream_generate, {}), (stream_generate, dict(draft_model=drafter, tree_topk=3, tree_depth=4))):
        cache = make_prompt_cache(target)
        got = []
        for r in fn(target, tok, "def parse(", max_tokens=40, prompt_cache=cache, **extra):
            got.append(r.token)
            if len(got) == k:
                break
        caches.append((cache, got))
    (theirs, a), (ours, b) = caches
    assert a == b and theirs[0].offset == ours[0].offset
    nxt = [[r.token for r in mlx_stream_generate(target, tok, "\nclass A:\n", max_tokens=12, prompt_cache=c)]
           for c in (theirs, ours)]
    assert nxt[0] == nxt[1]
