"""Tests for scoring.py and restore.py: perplexity, translation order, restoring and scoring a workdir."""

import json
import os
import re

import jax
import numpy as np
import pytest
from tiny import TRAIN, config_with, random_params, untrained_workdir

from transformer_jax import data as data_lib
from transformer_jax.checkpoints import restore
from transformer_jax.evaluation import decode, scoring, workdir_scoring
from transformer_jax.model import transformer as model_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import PAD_ID

VOCAB = 23


def _model_config():
    return ModelConfig(vocab_size=VOCAB, d_model=12, d_ff=20, num_heads=3, num_encoder_layers=1,
                                 num_decoder_layers=1, dropout_rate=0.0, max_len=32)


def _batch(rng, rows, src_len, tgt_len, num_real, first_index):
    inputs = rng.integers(4, VOCAB, size=(rows, src_len)).astype(np.int32)
    targets = rng.integers(4, VOCAB, size=(rows, tgt_len)).astype(np.int32)
    inputs[0, src_len - 2:] = PAD_ID
    targets[0, tgt_len - 3:] = PAD_ID
    inputs[num_real:] = PAD_ID
    targets[num_real:] = PAD_ID
    indices = np.arange(first_index, first_index + num_real)
    return data_lib.EvalBatch(inputs, targets, [f"s{i}" for i in indices], [f"t{i}" for i in indices],
                              indices, num_real)


def _batches():
    """Two batches whose rows, as the bucketing would, are out of split order: 5, 6, 7 then 0, 1, 2, 3, 4."""
    rng = np.random.default_rng(0)
    return [_batch(rng, 5, 7, 5, 3, 5), _batch(rng, 5, 3, 9, 5, 0)]


def _reference_nll(params, cfg, batches):
    """Sum of -log p(target) over non-pad targets, from the model's logits and a NumPy log-softmax."""
    forward = jax.jit(model_lib.Transformer(cfg.replace(deterministic=True)).apply)  # not op by op
    total, count = 0.0, 0
    for b in batches:
        logits = np.asarray(forward({"params": params}, b.inputs, b.targets), np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll = -np.take_along_axis(logp, b.targets[..., None], -1)[..., 0]
        mask = b.targets != PAD_ID
        total, count = total + nll[mask].sum(), count + mask.sum()
    return total, count


def test_perplexity_is_the_exponent_of_the_mean_token_nll():
    cfg, batches = _model_config(), _batches()
    params = random_params(cfg, seed=1)
    result = scoring.perplexity(params, cfg, batches)
    total, count = _reference_nll(params, cfg, batches)
    assert result["num_tokens"] == count == 3 * 5 - 3 + 5 * 9 - 3
    np.testing.assert_allclose(result["nll"], total / count, rtol=1e-5)
    np.testing.assert_allclose(result["ppl"], np.exp(total / count), rtol=1e-5)
    np.testing.assert_allclose(result["loss"], result["nll"], rtol=1e-6)  # no smoothing asked


class _DigitsTokenizer:
    """Decodes a row of ids to the ids themselves, so a test can see which row went where (PAD ignored,
    as the real tokenizer ignores it)."""

    def decode_batch(self, ids_2d):
        return [" ".join(str(int(i)) for i in row if i != PAD_ID) for row in ids_2d]


def test_translate_is_greedy_search_of_the_real_rows_in_split_order():
    cfg, batches = _model_config(), _batches()
    params = random_params(cfg, seed=2)
    got = scoring.translate(params, cfg, _DigitsTokenizer(), batches, beam_size=1, max_extra_len=4)
    assert len(got) == 8  # padding rows are not translated
    expected = {}
    for b in batches:
        tokens = np.asarray(decode.greedy_search(params, cfg, b.inputs, max_extra_len=4))
        for i, row in zip(b.indices, _DigitsTokenizer().decode_batch(tokens[: b.num_real]), strict=True):
            expected[int(i)] = row
    assert got == [expected[i] for i in range(8)]
    references, sources = scoring.references_and_sources(batches)
    assert references == [f"t{i}" for i in range(8)] and sources == [f"s{i}" for i in range(8)]


NUM_DEV = TRAIN["data.synthetic_dev_size"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A train.py-shaped workdir without training: a tokenizer and checkpoints 1, 2, 3 of the initial
    state, each parameter scaled by its step, so their average is known."""
    workdir = str(tmp_path_factory.mktemp("workdir"))
    saved = untrained_workdir(config_with(TRAIN), workdir, steps=(1, 2, 3))
    return workdir, saved


def _assert_params_equal(actual, expected, rtol=0.0):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), e, rtol=rtol, atol=1e-7)


def test_restore_workdir_reads_config_tokenizer_and_the_requested_step(workdir):
    path, saved = workdir
    latest = restore.restore_workdir(path)
    assert latest.step == 3 and latest.run.model.d_model == TRAIN["model.d_model"]
    assert latest.model_config.vocab_size == latest.tokenizer.vocab_size
    _assert_params_equal(latest.params, saved[3])
    _assert_params_equal(restore.restore_workdir(path, step=2).params, saved[2])


def test_restore_workdir_names_what_is_missing(tmp_path, workdir):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        restore.restore_workdir(str(tmp_path))
    os.makedirs(tmp_path / "checkpoints")
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "checkpoints"))):
        restore.restore_workdir(str(tmp_path))


def test_averaged_params_are_the_mean_of_the_last_n_up_to_the_step(workdir):
    path, saved = workdir
    restored = restore.restore_workdir(path, step=2)
    params, steps = restore.averaged_params(restored, 2)
    assert steps == [1, 2]
    _assert_params_equal(params, jax.tree.map(lambda a, b: (a + b) / 2, saved[1], saved[2]), rtol=1e-6)
    with pytest.raises(ValueError, match=r"average_last=3.*step 2.*\[1, 2\]"):
        restore.averaged_params(restored, 3)


def test_evaluate_workdir_writes_translations_and_numbers(workdir):
    path, _ = workdir
    results = workdir_scoring.evaluate_workdir(path, split="dev", beam_size=2, max_extra_len=3)
    txt, js = results["outputs"]
    assert (txt, js) == (os.path.join(path, "eval", "dev-3.txt"), os.path.join(path, "eval", "dev-3.json"))
    with open(txt) as f:
        assert len(f.read().splitlines()) == NUM_DEV == results["num_sentences"]
    with open(js) as f:
        written = json.load(f)
    assert (written["split"], written["step"], written["beam_size"]) == ("dev", 3, 2)
    assert np.isfinite(written["ppl"]) and written["ppl"] > 1
    assert 0 <= written["sacrebleu"] <= 100 and "table" in results
    assert written["decode_seconds"] > 0
    # Both are rounded to 2 decimals: up to 0.005 off, which is more than 1% below 0.5 sentences/s.
    assert written["sentences_per_second"] == pytest.approx(NUM_DEV / written["decode_seconds"], rel=0.01,
                                                            abs=0.006)
    with pytest.raises(ValueError, match="reference_file"):
        workdir_scoring.evaluate_workdir(path, source_file=txt)
