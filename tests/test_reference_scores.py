"""Scoring given references (``translate --score``): each token's log-probability equals the model's own
one-pair forward pass; the sums equal the perplexity metric's; the command pairs lines, the CTranslate2
engine agrees with the JAX one, and bad input is one line that writes nothing."""

import functools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from tiny import TRAIN, config_with, untrained_workdir

from transformer_jax.checkpoints import restore
from transformer_jax.evaluation import reference_scores
from transformer_jax.model import loss
from transformer_jax.model import transformer as model_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import EOS_ID

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 23
# Source and reference lengths (without EOS) of the pairs: empty ones, and lengths across three buckets.
LENGTHS = [(0, 3), (5, 0), (7, 9), (12, 4), (3, 17), (20, 19)]


def _pairs(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(sources with EOS, references without it) of ``LENGTHS``, random non-special ids."""
    rng = np.random.default_rng(seed)
    sources = [np.append(rng.integers(4, VOCAB, n), EOS_ID).astype(np.int32) for n, _ in LENGTHS]
    references = [rng.integers(4, VOCAB, m).astype(np.int32) for _, m in LENGTHS]
    return sources, references


def _model(position_encoding: str) -> tuple[ModelConfig, dict]:
    cfg = ModelConfig(vocab_size=VOCAB, d_model=12, d_ff=14, num_heads=2, d_k=6, d_v=6, num_encoder_layers=1,
                      num_decoder_layers=2, max_len=32, position_encoding=position_encoding)
    return cfg, model_lib.init_params(cfg, rng=jax.random.key(3, impl="rbg"))


@functools.partial(jax.jit, static_argnums=1)
def _logits(params, cfg: ModelConfig, inputs, targets) -> jax.Array:
    return model_lib.Transformer(cfg.replace(deterministic=True)).apply({"params": params}, inputs, targets)


def _one_pair_log_probs(params, cfg: ModelConfig, source: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """float64[len(reference) + 1]: log-softmax (in float64) of the unpadded one-pair forward pass."""
    target = np.append(reference, EOS_ID).astype(np.int32)
    logits = np.asarray(_logits(params, cfg, source[None], target[None])[0], np.float64)
    log_probs = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                       keepdims=True)) - logits.max(-1, keepdims=True)
    return log_probs[np.arange(len(target)), target]


@pytest.mark.parametrize("position_encoding", ["sinusoidal", "relative"])
def test_each_token_equals_the_one_pair_forward_whatever_the_batch(position_encoding):
    cfg, params = _model(position_encoding)
    sources, references = _pairs()
    expected = [_one_pair_log_probs(params, cfg, s, r) for s, r in zip(sources, references, strict=True)]
    for budget in (None, 24):  # every pair in one batch; one to three rows a batch
        scores = reference_scores.score_ids(params, cfg, sources, references, tokens_per_batch=budget)
        assert [len(s) for s in scores] == [m + 1 for _, m in LENGTHS]  # each token, then EOS
        for ours, theirs in zip(scores, expected, strict=True):
            np.testing.assert_allclose(ours, theirs, atol=2e-5)


def test_the_sums_equal_the_perplexity_metrics_nll():
    """An independent path: ``loss.cross_entropy_sums`` (logsumexp less the target's logit, no softmax)."""
    cfg, params = _model("sinusoidal")
    sources, references = _pairs(seed=1)
    scores = reference_scores.score_ids(params, cfg, sources, references)
    width = 21
    inputs = reference_scores._padded(sources, len(sources), width)
    targets = reference_scores._padded([np.append(r, EOS_ID) for r in references], len(sources), width)
    sums = loss.make_eval_step(cfg)(params, {"inputs": inputs, "targets": targets})
    assert float(sums["num_tokens"]) == sum(len(s) for s in scores)
    np.testing.assert_allclose(-sum(float(np.sum(s)) for s in scores), float(sums["nll"]), rtol=1e-5)


def test_the_lines_format_the_sum_then_each_token():
    text = reference_scores.format_scores([np.asarray([-0.5, -1.25], np.float32), np.asarray([-2.0])])
    assert text == "-1.750000\t-0.500000 -1.250000\n-2.000000\t-2.000000\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A train.py-shaped workdir without training (a tokenizer and checkpoint 1)."""
    workdir = str(tmp_path_factory.mktemp("workdir"))
    untrained_workdir(config_with(TRAIN), workdir)
    return workdir


SOURCES = ["the first sentence", "", "a second one, longer than the first one", "third"]
REFERENCES = ["die erste", "leer", "", "dritte dritte dritte"]


def _translate(args, stdin=""):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "transformer_jax.translate", *args], input=stdin,
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def _parsed(text: str) -> list[tuple[float, list[float]]]:
    out = []
    for line in text.splitlines():
        total, tokens = line.split("\t")
        out.append((float(total), [float(x) for x in tokens.split()]))
    return out


def test_the_command_scores_each_pair_on_both_engines(workdir, tmp_path):
    (tmp_path / "src.txt").write_text("\n".join(SOURCES) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(REFERENCES) + "\n")
    files = [f"--input={tmp_path / 'src.txt'}", f"--references={tmp_path / 'ref.txt'}"]
    result = _translate([f"--workdir={workdir}", "--score", *files])
    assert result.returncode == 0, result.stderr
    lines = _parsed(result.stdout)
    restored = restore.restore_workdir(workdir)
    sources, references = reference_scores.pair_ids(restored.tokenizer, SOURCES, REFERENCES, max_length=None,
                                                    locations=[""] * 4)
    expected = reference_scores.score_ids(restored.params, restored.model_config, sources, references)
    assert len(lines) == 4 and [len(tokens) for _, tokens in lines] == [len(r) + 1 for r in references]
    for (total, tokens), ours in zip(lines, expected, strict=True):
        np.testing.assert_allclose(tokens, ours, atol=1e-6)  # printed to 6 decimals
        assert total == pytest.approx(sum(tokens), abs=1e-5)
    # CTranslate2's score_batch through its export (made first), and --output.
    result = _translate([f"--workdir={workdir}", "--score", *files, "--engine=ctranslate2",
                         f"--output={tmp_path / 'scores.txt'}", "--stats"])
    assert result.returncode == 0, result.stderr
    for (total, tokens), (their_total, theirs) in zip(lines, _parsed((tmp_path / "scores.txt").read_text()),
                                                       strict=True):
        np.testing.assert_allclose(theirs, tokens, atol=1e-4)
        assert their_total == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize("args, references, message", [
    (["--score"], None, "--score needs --references=FILE"),
    ([], REFERENCES, "--references applies to --score"),
    (["--score", "--beam_size=4"], REFERENCES, "--beam_size sets the search; --score searches nothing"),
    (["--score", "--truncate"], REFERENCES, "--truncate sets the search"),
    (["--score"], REFERENCES[:3], "has 3 lines and {src} has 4; expected one reference a source line"),
])
def test_bad_input_is_one_line_and_writes_nothing(workdir, tmp_path, args, references, message):
    (tmp_path / "src.txt").write_text("\n".join(SOURCES) + "\n")
    files = [f"--input={tmp_path / 'src.txt'}", f"--output={tmp_path / 'out.txt'}"]
    if references is not None:
        (tmp_path / "ref.txt").write_text("\n".join(references) + "\n")
        files.append(f"--references={tmp_path / 'ref.txt'}")
    result = _translate([f"--workdir={workdir}", *args, *files])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and message.format(src=tmp_path / "src.txt") in error[0], result.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["src.txt"] + (["ref.txt"] if references else []))


def test_a_reference_longer_than_a_learned_table_names_its_line(tmp_path):
    workdir = str(tmp_path / "learned")
    untrained_workdir(config_with({**TRAIN, "model.position_encoding": "learned"}), workdir)
    (tmp_path / "src.txt").write_text("short\nshort\n")
    (tmp_path / "ref.txt").write_text("fine\n" + "word " * 400 + "\n")
    result = _translate([f"--workdir={workdir}", "--score", f"--input={tmp_path / 'src.txt'}",
                         f"--references={tmp_path / 'ref.txt'}"])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert (f"error: {tmp_path / 'src.txt'}:2 and {tmp_path / 'ref.txt'}:2: the reference has "
            in result.stderr), result.stderr
    assert "learned position table has model.max_len=256 positions" in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["learned", "ref.txt", "src.txt"]
