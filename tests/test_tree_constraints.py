"""Constrained tree decoding (transformer_jax/evaluation/tree_constraints.py): every output is a tree
over exactly the input words, for any model, with greedy and beam search."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import random_params

from transformer_jax.data import default_data_config, get_source, load_or_train_tokenizer
from transformer_jax.data.trees import delinearize, is_bracket, linearize, parse_trees
from transformer_jax.evaluation import decode, evalb, tree_constraints
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.ensemble import Ensemble
from transformer_jax.model.special_ids import EOS_ID, PAD_ID

MAX_EXTRA_LEN = 40
# Every decoded batch is ROWS sentences (repeated to fill) of SRC_LEN positions: one program per search.
ROWS, SRC_LEN = 13, 80


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tokenizer trained on the synthetic treebank with the words as leaves, and its test trees."""
    cfg = default_data_config(source="synthetic_trees", synthetic_train_size=300, synthetic_dev_size=5,
                              synthetic_test_size=13, vocab_size=150, tree_leaves="words")
    tokenizer = load_or_train_tokenizer(cfg, str(tmp_path_factory.mktemp("tok")))
    return tokenizer, get_source(cfg)


@functools.cache
def _model(vocab_size, seed=3):
    """A random tiny model (drawn in NumPy: nothing compiled); one per seed, shared by the tests."""
    config = ModelConfig(vocab_size=vocab_size, d_model=16, d_ff=24, num_heads=2, num_encoder_layers=1,
                         num_decoder_layers=1, max_len=160, dropout_rate=0.0)
    return config, random_params(config, seed)


def _inputs(tokenizer, sentences, src_len=None):
    """int32[batch, src_len] with EOS after each sentence's pieces, PAD after that (src_len: default the
    longest)."""
    ids = [tokenizer.encode(s) + [EOS_ID] for s in sentences]
    inputs = np.full((len(ids), src_len or max(map(len, ids))), PAD_ID, np.int32)
    for row, x in enumerate(ids):
        inputs[row, :len(x)] = x
    return inputs


def _decode(tokenizer, sentences, *, beam_size, constrained=True, seed=3, max_extra_len=MAX_EXTRA_LEN):
    """The token lists of each sentence's decoded tree (random model), for ``sentences`` repeated to ROWS."""
    seeds = seed if isinstance(seed, tuple) else (seed,)  # several: their ensemble decodes
    config, params = _model(tokenizer.vocab_size, seeds[0])
    if len(seeds) > 1:
        params = Ensemble(tuple(_model(tokenizer.vocab_size, s)[1] for s in seeds))
    sentences = [sentences[i % len(sentences)] for i in range(ROWS)]
    inputs = _inputs(tokenizer, sentences, SRC_LEN)
    constraint = tree_constraints.TreeConstraint.from_tokenizer(tokenizer) if constrained else None
    if beam_size == 1:
        out = decode.greedy_search(params, config, inputs, max_extra_len=max_extra_len,
                                   constraint=constraint)
    else:
        out, _ = decode.beam_search(params, config, inputs, beam_size=beam_size, alpha=0.3,
                                    max_extra_len=max_extra_len, constraint=constraint)
    out = np.asarray(out)
    return [tree_constraints.output_tokens(row, tokenizer, src, s.split())
            for row, src, s in zip(out, inputs, sentences, strict=True)], out


def _check_trees(token_lists, sentences):
    for tokens, sentence in zip(token_lists, sentences, strict=True):
        words = sentence.split()
        assert not evalb.yield_differs(tokens, words, word_leaves=True), (tokens, words)
        tree = delinearize(tokens, words)  # strict: raises on unbalanced or mislabeled brackets
        assert tree.words() == words
        assert all(t == w for t, w in zip((t for t in tokens if not is_bracket(t)), words, strict=True))


def test_tokenizer_brackets_are_single_ids_and_words_keep_their_source_pieces(setup):
    tokenizer, source = setup
    bracket_of = {token: i for i, token in tokenizer.bracket_ids.items()}
    assert "(NP" in bracket_of and ")NP" in bracket_of and ")S" in bracket_of
    for words, target in source.pairs("train")[:100]:
        ids = tokenizer.encode(target)
        brackets = [i for i in ids if i in tokenizer.bracket_ids]
        assert brackets == [bracket_of[t] for t in target.split() if is_bracket(t)]
        assert [i for i in ids if i not in tokenizer.bracket_ids] == tokenizer.encode(words)
    assert not set(tokenizer.encode("the dog sees a cat .")) & set(tokenizer.bracket_ids)


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("seed", [3, 11, (3, 11)])
def test_random_models_output_trees_over_the_input_words(setup, beam_size, seed):
    tokenizer, source = setup
    sentences = [words for words, _ in source.pairs("test")]
    assert len(sentences) == ROWS
    token_lists, _ = _decode(tokenizer, sentences, beam_size=beam_size, seed=seed)
    _check_trees(token_lists, sentences)


def test_unconstrained_random_model_breaks_the_yield(setup):
    """The check above can fail: without the constraint the same models' leaves are not the words."""
    tokenizer, source = setup
    sentences = [words for words, _ in source.pairs("test")]
    token_lists, _ = _decode(tokenizer, sentences, beam_size=1, constrained=False)
    assert sum(evalb.yield_differs(t, s.split(), word_leaves=True)
               for t, s in zip(token_lists, sentences, strict=True)) > len(sentences) // 2


ADVERSARIAL = {
    "unknown words": "Zqxj 日本語 the Ω dog ŋŋŋ",
    "repeated words": "the the the the dog dog dog the the",
    "one word": "dog",
    "one unknown word": "日本語",
    "sixty words": " ".join(["the", "big", "dog", "saw", "a", "cat", "in", "the", "garden", ","] * 6),
}


@pytest.mark.parametrize("beam_size", [1, 4])
def test_adversarial_inputs(setup, beam_size):
    tokenizer, _ = setup
    sentences = list(ADVERSARIAL.values())
    assert len(sentences[-1].split()) == 60
    token_lists, out = _decode(tokenizer, sentences, beam_size=beam_size)
    _check_trees(token_lists, [sentences[i % len(sentences)] for i in range(ROWS)])
    # Unknown words come back as themselves, not as the UNK mark.
    assert [t for t in token_lists[0] if not is_bracket(t)] == sentences[0].split()
    assert (out == EOS_ID).any(axis=1).all()  # every row ended with EOS within its length limit


def _jitted(constraint, *names):
    """The automaton's functions ``names``, each compiled whole (not an operation at a time)."""
    return [jax.jit(getattr(constraint, name)) for name in names]


def _random_walk(constraint, inputs, limits, steps, seed):
    """Drives the automaton with random scores (no model): the token chosen at each step is the
    best allowed one under uniform noise."""
    rng = np.random.default_rng(seed)
    init, allowed_at, advance = _jitted(constraint, "init", "allowed", "advance")
    state = init(jnp.asarray(inputs), jnp.asarray(limits))
    tokens, done = [], np.zeros(len(inputs), bool)
    for t in range(steps):
        allowed = np.asarray(allowed_at(state, jnp.int32(t)))
        assert allowed.any(axis=1).all()
        scores = np.where(allowed, rng.random(allowed.shape), -1.0)
        # Favour EOS and closers a little less than opens, so deep trees show up too.
        token = np.where(done, PAD_ID, scores.argmax(axis=1)).astype(np.int32)
        tokens.append(token)
        done |= token == EOS_ID
        state = advance(state, jnp.asarray(token))
        if done.all():
            break
    return np.stack(tokens, axis=1), np.asarray(state.depth)


def test_random_walks_respect_depth_and_length_limits(setup):
    tokenizer, source = setup
    sentences = [words for words, _ in source.pairs("test")][:7]
    inputs = _inputs(tokenizer, sentences)
    pieces = (inputs != PAD_ID).sum(axis=1) - 1
    limits = (pieces + np.array([3, 5, 8, 13, 30, 60, 100]))[: len(sentences)].astype(np.int32)
    constraint = tree_constraints.TreeConstraint.from_tokenizer(tokenizer, max_depth=3, max_open_run=2)
    out, depth = _random_walk(constraint, inputs, limits, int(limits.max()), seed=0)
    assert (depth == 0).all()
    for row, (tokens, sentence) in enumerate(zip(out, sentences, strict=True)):
        length = list(tokens).index(EOS_ID) + 1  # EOS included
        assert length <= limits[row]
        linear = tree_constraints.output_tokens(tokens, tokenizer, inputs[row], sentence.split())
        _check_trees([linear], [sentence])
        running, deepest = 0, 0
        for token in linear:
            running += token.startswith("(") - token.startswith(")")
            deepest = max(deepest, running)
        assert deepest <= 3
        run = 0
        for token in linear:  # at most max_open_run opening brackets between two words
            run = run + 1 if token.startswith("(") else 0 if not is_bracket(token) else run
            assert run <= 2
    # The tightest limit (pieces + 3) allows only one root over the words.
    tight = tree_constraints.output_tokens(out[0], tokenizer, inputs[0], sentences[0].split())
    assert sum(is_bracket(t) for t in tight) == 2


def test_output_tokens_marks_a_wrong_copy(setup):
    """A row whose pieces are not the source's is written with its own text, so the mismatch shows."""
    tokenizer, _ = setup
    bracket_of = {token: i for i, token in tokenizer.bracket_ids.items()}
    src = tokenizer.encode("the dog")
    row = [bracket_of["(S"], *tokenizer.encode("the cat"), bracket_of[")S"], EOS_ID, PAD_ID]
    tokens = tree_constraints.output_tokens(row, tokenizer, src + [EOS_ID], ["the", "dog"])
    assert tokens == ["(S", "the", "cat", ")S"]
    assert evalb.yield_differs(tokens, ["the", "dog"], word_leaves=True)


def test_linearize_with_words_round_trips():
    tree = parse_trees("(S (NP (DT The) (NN dog)) (VP (VBZ barks)) (. .))")[0]
    words, tokens = linearize(tree, copy_words=True)
    assert tokens == ["(S", "(NP", "The", "dog", ")NP", "(VP", "barks", ")VP", ".", ")S"]
    assert delinearize(tokens, words).words() == words


def test_constraint_needs_brackets():
    class Plain:
        bracket_ids: dict = {}
        vocab_size = 10
    assert tree_constraints.TreeConstraint.from_tokenizer(Plain()) is None
    with pytest.raises(ValueError, match="one close id per open id"):
        tree_constraints.TreeConstraint(vocab_size=10, open_ids=(4, 5), close_ids=(6,), word_start_ids=())


def test_the_copy_scores_the_probability_of_every_piece(setup):
    """With uniform logits the copy's score is log(pieces / vocab); brackets keep log(1 / vocab)."""
    tokenizer, _ = setup
    constraint = tree_constraints.TreeConstraint.from_tokenizer(tokenizer)
    init, advance, scores_at, allowed_at = _jitted(constraint, "init", "advance", "scores", "allowed")
    inputs = _inputs(tokenizer, ["the dog"])
    state = init(jnp.asarray(inputs), jnp.asarray([50], jnp.int32))
    (open_s,) = [i for i, t in tokenizer.bracket_ids.items() if t == "(S"]
    state = advance(state, jnp.asarray([open_s], jnp.int32))  # inside (S: copy or open
    vocab = tokenizer.vocab_size
    scores = np.asarray(scores_at(state, jnp.int32(1), jnp.zeros((1, vocab))))[0]
    pieces = vocab - len(tokenizer.bracket_ids) - 3  # all but brackets, PAD, EOS and BOS
    np.testing.assert_allclose(scores[inputs[0, 0]], np.log(pieces / vocab), atol=1e-5)
    np.testing.assert_allclose(scores[open_s], np.log(1 / vocab), atol=1e-5)
    allowed = np.asarray(allowed_at(state, jnp.int32(1)))[0]
    assert ((scores > -1e6) == allowed).all()
    assert allowed.sum() == len(tokenizer.bracket_ids) // 2 + 1  # every opening bracket and the copy
