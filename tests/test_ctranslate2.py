"""CTranslate2 as a witness of the model: an independent C++ decoder fed our exported weights must give the
JAX decoder's greedy outputs token for token, and the same per-token log probabilities.

Tiny models (post-norm, pre-norm, learned positions) are trained here for a few seconds on reversing a
word sequence, so that their outputs are confident and long; one untrained model with large random
weights rarely emits EOS and checks the length limits. Sources have at most 8 tokens (one padded width)
and every search allows 3 more, so each model decodes with one compiled program. A wrong export (one
transposed kernel) must fail the same comparison. The export and translate commands run end to end on a
tiny workdir.
"""

import dataclasses
import errno
import functools
import json
import os
import shutil
import socket
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from tiny import TRAIN, config_with, random_params, untrained_workdir

from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.evaluation import ctranslate2_engine, ctranslate2_spec, translation, workdir_scoring
from transformer_jax.model import transformer as model_lib
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.runtime import disk
from transformer_jax.runtime.errors import ConfigError, DiskFullError, UserError

try:
    import ctranslate2
except ImportError:
    if os.environ.get("CI"):
        raise  # CI installs the test extra, which includes ctranslate2
    pytest.skip(f"CTranslate2 tests skipped: ctranslate2 is not installed; {ctranslate2_spec.INSTALL_HINT}",
                allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCORE_TOLERANCE = 1e-4  # per-token log probability, float32 in both engines
NUM_WORDS, MAX_WORDS = 40, 7  # MAX_WORDS + EOS: the one padded source width
MAX_EXTRA_LEN = 3
# The witnessed models: post-norm with 2 + 2 layers (an export that mixes up layers changes the outputs);
# pre-norm and learned positions, which are not per layer, with 1 + 1. The learned-position model has
# d_k = d_v = 16 != d_model / h (CTranslate2's head_dim), and its untrained twin checks the length limits
# (one compiled search for both).
VARIANTS = {
    "post_norm": {},
    "pre_norm": {"norm_style": "pre", "num_encoder_layers": 1, "num_decoder_layers": 1},
    "learned_positions": {"position_encoding": "learned", "d_k": 16, "d_v": 16, "num_encoder_layers": 1,
                          "num_decoder_layers": 1},
}


@functools.cache
def word_tokenizer() -> tokenizer_lib.Tokenizer:
    """A word-level SentencePiece model over the words w0..w39: 44 pieces, specials included."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(NUM_WORDS)]
    sentences = [" ".join(rng.choice(words, rng.integers(3, 12))) for _ in range(2000)]
    return tokenizer_lib.Tokenizer(tokenizer_lib.train_tokenizer(sentences, vocab_size=44, vocab_type="word"))


@pytest.fixture(scope="module")
def pieces():
    """The pieces of :func:`word_tokenizer`, one a token id."""
    return ctranslate2_engine.workdir_pieces(word_tokenizer())


def _model_config(vocab_size: int, **overrides) -> ModelConfig:
    fields = dict(d_model=32, d_ff=64, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, max_len=64,
                  dropout_rate=0.0)
    return ModelConfig(vocab_size=vocab_size, **{**fields, **overrides})


def _reversal_batch(rng, n: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """int32[n, MAX_WORDS + 1] sources and targets: random word ids + EOS, and the same words reversed."""
    sources = np.full((n, MAX_WORDS + 1), PAD_ID, np.int32)
    targets = np.full_like(sources, PAD_ID)
    for row, length in enumerate(rng.integers(2, MAX_WORDS + 1, n)):
        words = rng.integers(4, vocab_size, length)
        sources[row, :length + 1] = [*words, EOS_ID]
        targets[row, :length + 1] = [*words[::-1], EOS_ID]
    return sources, targets


@functools.cache
def _train(cfg: ModelConfig, steps: int = 300):
    """Parameters of ``cfg`` after ``steps`` Adam steps on word reversal (loss about 0.2-0.9) from
    ``random_params`` (drawn by NumPy: no initializer to compile); cached, so the tests of one model train
    it once."""
    model = model_lib.Transformer(cfg.replace(deterministic=True))
    params = random_params(cfg, seed=1)
    optimizer = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state, sources, targets):
        def loss_fn(p):
            logits = model.apply({"params": p}, sources, targets)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
            weights = targets != PAD_ID
            return (losses * weights).sum() / weights.sum()

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    rng, opt_state = np.random.default_rng(2), optimizer.init(params)
    for _ in range(steps):
        params, opt_state = step(params, opt_state, *_reversal_batch(rng, 32, cfg.vocab_size))
    return jax.tree.map(np.asarray, params)


def _padded(rows: list[np.ndarray], width: int) -> np.ndarray:
    """int32[n, width]: ``rows`` right-padded with PAD."""
    out = np.full((len(rows), width), PAD_ID, np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


def _teacher_forced_log_probs(params, cfg: ModelConfig, sources: list[np.ndarray],
                              outputs: list[np.ndarray]) -> list[np.ndarray]:
    """float[len(output)] per sentence: our model's log P of each token of its output (up to and including
    EOS, no PAD), all sentences in one batch padded to the widths of every test (the masks keep the
    padding out)."""
    outputs = [output[output != PAD_ID] for output in outputs]
    width = MAX_WORDS + 1
    logits = model_lib.Transformer(cfg.replace(deterministic=True)).apply(
        {"params": params}, _padded(sources, width), _padded(outputs, width + MAX_EXTRA_LEN))  # [n, T, V]
    log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return [lp[np.arange(len(output)), output] for lp, output in zip(log_probs, outputs, strict=True)]


def _witness(params, cfg: ModelConfig, pieces: list[str], out_dir: str, *,
             sentences: int = 64) -> tuple[int, float, list[np.ndarray]]:
    """Exports ``params`` and decodes the same sources greedily with both engines.

    Returns:
      (sentences whose outputs differ, the largest per-token log-probability difference on our outputs,
      our outputs).
    """
    ctranslate2_engine.write_model(params, cfg, out_dir, pieces=pieces, quantization="float32", record={})
    engine = ctranslate2_engine.Engine(out_dir, threads=1)
    sources, _ = _reversal_batch(np.random.default_rng(9), sentences, cfg.vocab_size)
    ids = [row[:list(row).index(EOS_ID) + 1] for row in sources]
    settings = translation.Settings(beam_size=1, max_extra_len=MAX_EXTRA_LEN)
    ours = translation.decode_ids(params, cfg, ids, settings)
    theirs = engine.decode_ids(ids, settings)
    differing = sum(not np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    largest = 0.0
    ours_scored = _teacher_forced_log_probs(params, cfg, ids, ours)
    for our_log_probs, their_log_probs in zip(ours_scored, engine.score(ids, ours), strict=True):
        # CTranslate2 scores EOS after an output that reached its limit without one: compare the tokens.
        largest = max(largest, float(np.abs(our_log_probs - their_log_probs[:len(our_log_probs)]).max()))
    return differing, largest, ours


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trained_model_greedy_outputs_and_scores_equal_ours(variant, pieces, tmp_path):
    cfg = _model_config(len(pieces), **VARIANTS[variant])
    differing, largest, _ = _witness(_train(cfg), cfg, pieces, str(tmp_path / "model"))
    assert differing == 0
    assert largest <= SCORE_TOLERANCE


@pytest.mark.parametrize("ffn_activation", ["gelu", "gelu_tanh", "gelu_sigmoid", "swish"])
def test_each_ffn_activation_exports_as_ctranslate2s_same_function(ffn_activation, pieces, tmp_path):
    """Random weights, pre-norm (the FFN's output reaches the logits without a LayerNorm between). The
    erf GELU and its tanh form differ by at most 5e-4: swapped in the export, they moved the
    log-probabilities by 1.3e-4; mapped right, the engines differed by under 1e-6."""
    cfg = _model_config(len(pieces), ffn_activation=ffn_activation, norm_style="pre", num_encoder_layers=1,
                        num_decoder_layers=1)
    differing, largest, _ = _witness(random_params(cfg, seed=5), cfg, pieces, str(tmp_path / "model"),
                                     sentences=16)
    assert differing == 0
    assert largest <= 1e-5


def test_the_export_decodes_through_ctranslate2s_own_api(pieces, tmp_path):
    """As CTranslate2's documentation shows, without this project's engine: a Translator on the export, the
    SentencePiece pieces of each sentence (no EOS), translate_batch and score_batch with their defaults.
    The greedy translations are the JAX engine's and the log probabilities ours: the export's config has
    CTranslate2 append the EOS our model reads at the end of every source."""
    import sentencepiece

    cfg = _model_config(len(pieces))
    params = _train(cfg)
    tokenizer_path = tmp_path / "spm.model"
    tokenizer_path.write_bytes(word_tokenizer().model_proto)
    out_dir = str(tmp_path / "model")
    ctranslate2_engine.write_model(params, cfg, out_dir, pieces=pieces, quantization="float32", record={},
                                   tokenizer_path=str(tokenizer_path))
    sources, _ = _reversal_batch(np.random.default_rng(9), 16, cfg.vocab_size)
    texts = [word_tokenizer().decode(row) for row in sources]

    translator = ctranslate2.Translator(out_dir)
    sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(out_dir, "spm.model"))
    source_pieces = sp.encode(texts, out_type=str)
    results = translator.translate_batch(source_pieces, beam_size=1)
    theirs = [sp.decode(result.hypotheses[0]) for result in results]

    settings = translation.Settings(beam_size=1, max_extra_len=MAX_EXTRA_LEN)
    assert theirs == translation.translate_texts(params, cfg, word_tokenizer(), texts, settings)
    target_pieces = sp.encode(theirs, out_type=str)
    scores = translator.score_batch(source_pieces, target_pieces)  # each token's, then EOS's
    ids = [np.asarray([*sp.piece_to_id(p), EOS_ID], np.int32) for p in source_pieces]
    outputs = [np.asarray([*sp.piece_to_id(p), EOS_ID], np.int32) for p in target_pieces]
    for ours, score in zip(_teacher_forced_log_probs(params, cfg, ids, outputs), scores, strict=True):
        np.testing.assert_allclose(score.log_probs, ours, atol=SCORE_TOLERANCE)


def test_outputs_that_reach_their_length_limit_are_equal(pieces, tmp_path):
    """Wide random weights: outputs run to ``source length + max_extra_len`` without EOS, cut per
    sentence as ours are, although CTranslate2 takes one length limit per call."""
    cfg = _model_config(len(pieces), **VARIANTS["learned_positions"])
    differing, largest, outputs = _witness(random_params(cfg, seed=5, unit_embedding=True), cfg, pieces,
                                           str(tmp_path / "model"))
    assert differing == 0
    assert largest <= SCORE_TOLERANCE
    assert sum(EOS_ID not in out for out in outputs) >= 16  # the limits were reached often


def test_a_transposed_kernel_fails_the_witness(pieces, tmp_path, monkeypatch):
    """The same comparison on an export whose encoder-decoder query kernel of one layer is transposed
    (square: [d_model, h * d_k] with h * d_k = d_model) must find different outputs and scores."""
    cfg = _model_config(len(pieces))
    set_cross_attention = ctranslate2_spec._set_cross_attention

    def transposed_query(spec, attention, norm):
        set_cross_attention(spec, attention, norm)
        spec.linear[0].weight = np.ascontiguousarray(spec.linear[0].weight.T)

    monkeypatch.setattr(ctranslate2_spec, "_set_cross_attention", transposed_query)
    differing, largest, _ = _witness(_train(cfg), cfg, pieces, str(tmp_path / "model"))
    assert differing > 0
    assert largest > 100 * SCORE_TOLERANCE


def test_d_k_other_than_d_v_is_refused_before_writing(pieces, tmp_path):
    cfg = _model_config(len(pieces), d_k=8, d_v=16)
    params = jax.tree.map(np.zeros_like, jax.eval_shape(lambda k: model_lib.init_params(cfg, rng=k),
                                                        jax.random.key(0)))
    with pytest.raises(ConfigError, match="d_k=8 and d_v=16"):
        ctranslate2_engine.write_model(params, cfg, str(tmp_path / "model"), quantization="float32",
                                       pieces=pieces, record={})
    assert not os.listdir(tmp_path)


def test_a_model_field_the_export_does_not_know_is_refused(pieces):
    @dataclasses.dataclass(frozen=True)
    class NewModelConfig(ModelConfig):
        rotary_positions: bool = True

    with pytest.raises(ConfigError, match="does not know the model field rotary_positions=True"):
        ctranslate2_spec.check_exportable(NewModelConfig(vocab_size=len(pieces), d_model=32, num_heads=4))


def test_bfloat16_export_halves_the_weights_without_torch(pieces, tmp_path):
    """CTranslate2 casts to bfloat16 through PyTorch; the export casts with ml_dtypes instead. On this CPU
    (no bfloat16 kernels) the model computes in float32, so it decodes exactly as a float32 export of the
    weights rounded to bfloat16."""
    import ml_dtypes

    if "bfloat16" in ctranslate2.get_supported_compute_types("cpu"):
        pytest.skip("this CPU computes in bfloat16, so outputs may differ from float32's")
    cfg = _model_config(len(pieces))
    params = _train(cfg)
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), params)
    sources, _ = _reversal_batch(np.random.default_rng(9), 32, cfg.vocab_size)
    ids = [row[:list(row).index(EOS_ID) + 1] for row in sources]
    sizes, outputs = {}, {}
    for name, weights, quantization in (("bfloat16", params, "bfloat16"), ("rounded", rounded, "float32")):
        out_dir = tmp_path / name
        ctranslate2_engine.write_model(weights, cfg, str(out_dir), pieces=pieces, quantization=quantization,
                                       record={})
        sizes[name] = os.path.getsize(out_dir / "model.bin")
        engine = ctranslate2_engine.Engine(str(out_dir), threads=1)
        assert engine.compute_type == "float32"
        outputs[name] = engine.decode_ids(ids, translation.Settings(beam_size=1, max_extra_len=MAX_EXTRA_LEN))
    for ours, theirs in zip(outputs["bfloat16"], outputs["rounded"], strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert 0.45 < sizes["bfloat16"] / sizes["rounded"] < 0.55


def test_missing_ctranslate2_is_one_line_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[serve\]"'):
        ctranslate2_engine.import_ctranslate2()


def test_matched_length_penalty():
    """d log lp / d log |Y| of GNMT's ((5 + |Y|) / 6)^alpha at the median length; 0 for alpha 0."""
    assert ctranslate2_engine.matched_length_penalty(0.6, [3, 15, 40]) == pytest.approx(0.6 * 15 / 20)
    assert ctranslate2_engine.matched_length_penalty(0.0, [3, 15, 40]) == 0.0
    lengths = np.array([10.0, 15.0, 20.0])
    gnmt = np.log(((5 + lengths) / 6) ** 1.0)
    slope = (gnmt[2] - gnmt[0]) / (np.log(20) - np.log(10))
    assert ctranslate2_engine.matched_length_penalty(1.0, [15]) == pytest.approx(slope, rel=0.05)


# --------------------------------------------------------------------------------------------------
# The commands, end to end on a tiny workdir.

# The end-to-end tests' tiny model, untrained, its final report the mean of checkpoints 1 and 2.
TINY = {**TRAIN, "final_average_last": 2}
# What they translate greedily (one search shape, compiled once for both JAX references).
SENTENCES = "the red house\n\nmy dog sleeps in the garden\na cat\n"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny train.py workdir with checkpoints 1 and 2 (untrained; the final report averages both)."""
    workdir = str(tmp_path_factory.mktemp("workdir"))
    untrained_workdir(config_with(TINY), workdir, steps=(1, 2))
    return workdir


def _command(module_args, stdin=""):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", *module_args], input=stdin, capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


@pytest.mark.slow
def test_export_and_translate_commands(workdir, tmp_path):
    (tmp_path / "in.txt").write_text(SENTENCES)
    # The reference: what translate --beam_size=1 (its JAX engine) writes, decoded in this process.
    workdir_scoring.translate_workdir(workdir, input_path=str(tmp_path / "in.txt"),
                                      output_path=str(tmp_path / "jax.txt"), beam_size=1)

    export = _command(["transformer_jax.export", f"--workdir={workdir}"])
    assert export.returncode == 0, export.stderr
    out_dir = ctranslate2_engine.default_export_dir(workdir)
    assert f"exported the mean of steps 1, 2 as float32 to {out_dir}" in export.stdout
    record = ctranslate2_engine.read_record(out_dir)
    assert (record["step"], record["averaged_steps"], record["quantization"]) == (2, [1, 2], "float32")
    assert len(record["config_sha256"]) == 64
    with open(os.path.join(workdir, "tokenizer", "spm.model"), "rb") as ours, \
            open(os.path.join(out_dir, ctranslate2_engine.TOKENIZER_FILE), "rb") as copied:
        assert ours.read() == copied.read()

    ct2_run = _command(["transformer_jax.translate", f"--workdir={workdir}", "--beam_size=1",
                        "--engine=ctranslate2", "--threads=1"], SENTENCES)
    assert ct2_run.returncode == 0, ct2_run.stderr
    assert ct2_run.stdout == (tmp_path / "jax.txt").read_text()
    assert any(ct2_run.stdout.splitlines())  # not only empty outputs
    assert ct2_run.stdout.splitlines()[1] == ""  # the empty line stays empty

    # A step the export does not hold is refused with the command that exports it.
    refused = _command(["transformer_jax.translate", f"--workdir={workdir}", "--engine=ctranslate2",
                        "--step=1"], SENTENCES)
    assert refused.returncode == 1
    assert refused.stderr.startswith(f"error: --step=1, but {out_dir} holds step 2;")
    assert "python -m transformer_jax.export" in refused.stderr


def test_export_refuses_an_unknown_quantization_and_a_foreign_folder(workdir, tmp_path):
    bad = _command(["transformer_jax.export", f"--workdir={workdir}", "--quantization=int4"])
    assert bad.returncode == 1 and "int4" in bad.stderr.splitlines()[0]
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    refused = _command(["transformer_jax.export", f"--workdir={workdir}", f"--out={foreign}"])
    assert refused.returncode == 1
    assert refused.stderr.splitlines()[0] == (f"error: --out={foreign} exists and is not an export; choose "
                                              "a new or empty folder")
    assert os.listdir(foreign) == ["keep.txt"]


@pytest.mark.slow
def test_evaluate_with_ctranslate2_names_its_outputs_and_matches_jax_greedy(workdir, tmp_path):
    outputs = {}
    run = _command(["evaluate", f"--workdir={workdir}", "--split=dev", "--beam_size=1",
                    f"--output_dir={tmp_path}", "--engine=ctranslate2"])
    assert run.returncode == 0, run.stderr
    workdir_scoring.evaluate_workdir(workdir, split="dev", beam_size=1, output_dir=str(tmp_path),
                                     engine="jax")  # the reference, in this process
    with open(tmp_path / "dev-2-avg2.txt") as f:
        outputs["jax"] = f.read()
    with open(tmp_path / "dev-2-avg2-ctranslate2.txt") as f:
        outputs["ctranslate2"] = f.read()
    assert outputs["ctranslate2"] == outputs["jax"]
    with open(tmp_path / "dev-2-avg2-ctranslate2.json") as f:
        result = json.load(f)
    assert (result["engine"], result["quantization"]) == ("ctranslate2", "float32")


def test_evaluate_refuses_a_model_the_export_cannot_express_before_claiming_or_computing(tmp_path,
                                                                                      monkeypatch):
    """d_k != d_v: refused in one line before the outputs are claimed and before perplexity or the
    averaged parameters are computed."""
    workdir = str(tmp_path / "workdir")
    untrained_workdir(config_with({**TINY, "model.d_k": 6, "model.d_v": 4}), workdir, steps=(2,))
    for module, name in ((workdir_scoring.evaluate_args, "claimed_outputs"),
                         (workdir_scoring.scoring, "perplexity"), (workdir_scoring, "averaged_params")):
        monkeypatch.setattr(module, name, lambda *a, name=name, **k: pytest.fail(f"{name} before the check"))
    with pytest.raises(ConfigError, match=r"^CTranslate2 has one head size, but this model has d_k=6 and "
                       "d_v=4"):
        workdir_scoring.evaluate_workdir(workdir, split="dev", beam_size=1, output_dir=str(tmp_path / "eval"),
                                         engine="ctranslate2")
    assert os.listdir(tmp_path / "eval") == []  # no claim, no output


def test_throughput_benchmark_has_a_ctranslate2_column(workdir, tmp_path, capsys):
    """Greedy float32: CTranslate2's outputs are JAX's, so their target token counts are equal."""
    from transformer_jax.benchmarks import decoding

    (tmp_path / "in.txt").write_text(SENTENCES)
    records = decoding.bench_throughput(str(tmp_path / "in.txt"), workdir, num_sentences=None, beam_size=1,
                                        repeats=1, engines=("jax", "ctranslate2"),
                                        quantizations=("float32", "int8"), threads=1)
    assert [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()] == records
    assert [(r["engine"], r.get("quantization")) for r in records] == [
        ("jax", None), ("ctranslate2", "float32"), ("ctranslate2", "int8")]
    assert records[1]["target_tokens"] == records[0]["target_tokens"]
    assert records[2]["compute_type"].startswith("int8")


def test_an_output_does_not_depend_on_the_other_sentences(pieces, tmp_path):
    """Beam 4 on wide random weights (outputs run long): 60 short sentences decode the same alone and
    beside 30-token ones. One length limit for a whole call let a short sentence's beam outgrow its own
    limit, win, and be cut without EOS; one length penalty matched at the median moved with the others."""
    cfg = _model_config(len(pieces), **VARIANTS["pre_norm"])  # max_len 64
    out_dir = str(tmp_path / "model")
    ctranslate2_engine.write_model(random_params(cfg, seed=5, unit_embedding=True), cfg, out_dir,
                                   pieces=pieces, quantization="float32", record={})
    engine = ctranslate2_engine.Engine(out_dir, threads=1)
    rng = np.random.default_rng(11)
    short = [np.asarray([*rng.integers(4, len(pieces), n), EOS_ID], np.int32) for n in rng.integers(2, 7, 60)]
    long = [np.asarray([*rng.integers(4, len(pieces), 29), EOS_ID], np.int32) for _ in range(61)]
    for alpha in (0.0, 0.6):
        settings = translation.Settings(beam_size=4, alpha=alpha, max_extra_len=MAX_EXTRA_LEN)
        alone = engine.decode_ids(short, settings)
        beside = engine.decode_ids([*long[:30], *short, *long[30:]], settings)[30:90]
        assert sum(not np.array_equal(a, b) for a, b in zip(alone, beside, strict=True)) == 0, alpha
        assert [len(out) for out in alone] == [len(s) + MAX_EXTRA_LEN for s in short]


def _exported_copy(workdir, tmp_path) -> str:
    """A fresh export of the module's workdir (made once), copied to ``tmp_path/export``."""
    made = os.path.join(workdir, "export", "made-once")
    if not os.path.isdir(made):
        ctranslate2_engine.export_workdir(workdir, out_dir=made)
    copy = str(tmp_path / "export")
    shutil.copytree(made, copy)
    return copy


def _translate_with(workdir, export_dir, **kwargs):
    return workdir_scoring.translate_workdir(workdir, input_path=str(_sentences_file(export_dir)),
                                             engine="ctranslate2", export_dir=export_dir, beam_size=1,
                                             threads=1, **kwargs)


def _sentences_file(export_dir) -> str:
    path = os.path.join(os.path.dirname(export_dir), "in.txt")
    with open(path, "w") as f:
        f.write(SENTENCES)
    return path


def _append(path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def _truncate(path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _flip_a_bit(path, offset: int | None = None) -> None:
    """One bit flipped at ``offset`` (default: a weight in the middle of the file): same size."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 if offset is None else offset)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def _flip_a_bit_in_a_name(path) -> None:
    """One bit flipped inside a variable's name in model.bin: CTranslate2 then misses that variable."""
    with open(path, "rb") as f:
        offset = f.read().index(b"encoder/layer_0/self_attention/linear_0/weight")
    _flip_a_bit(path, offset + len("encoder/layer_0/self_"))


@pytest.mark.parametrize("damage, what", [
    (lambda d: os.remove(os.path.join(d, "model.bin")), "model.bin does not read (No such file"),
    (lambda d: _truncate(os.path.join(d, "model.bin"), 1000), "model.bin changed after the export (sha256 "),
    (lambda d: _append(os.path.join(d, "export.json"), b"{"), "export.json does not read (JSONDecodeError"),
    (lambda d: _append(os.path.join(d, "spm.model"), b"garbage"), "spm.model changed after the export"),
    (lambda d: os.remove(os.path.join(d, "shared_vocabulary.json")), "shared_vocabulary.json does not read"),
    (lambda d: _flip_a_bit(os.path.join(d, "model.bin")), "model.bin changed after the export (sha256 "),
    (lambda d: _flip_a_bit_in_a_name(os.path.join(d, "model.bin")), "model.bin changed after the export"),
])
def test_a_damaged_export_is_one_line_with_the_command_that_remakes_it(workdir, tmp_path, damage, what):
    export_dir = _exported_copy(workdir, tmp_path)
    damage(export_dir)
    with pytest.raises(UserError) as error:  # one line, no traceback
        _translate_with(workdir, export_dir, output_path=str(tmp_path / "out.txt"))
    message = str(error.value)
    assert message.startswith(f"the CTranslate2 export in {export_dir} is damaged: ") and what in message
    assert message.endswith(f"Make it again with: python -m transformer_jax.export --workdir={workdir} "
                            f"--out={export_dir}")
    assert not os.path.exists(tmp_path / "out.txt")


def test_an_export_of_another_run_is_refused(workdir, tmp_path):
    other = str(tmp_path / "other")
    untrained_workdir(config_with({**TINY, "seed": 7}), other, steps=(2,))
    export_dir = _exported_copy(workdir, tmp_path)
    _translate_with(workdir, export_dir, output_path=str(tmp_path / "ours.txt"))  # its own run: fine
    with pytest.raises(ConfigError) as error:
        _translate_with(other, export_dir, output_path=str(tmp_path / "out.txt"))
    assert str(error.value).startswith(f"{export_dir} was exported from another run than --workdir={other} "
                                       "(step 2's saved config has sha256 ")
    assert str(error.value).endswith(f"export this run's model with: python -m transformer_jax.export "
                                     f"--workdir={other} (then leave --export_dir out)")
    with open(os.path.join(other, "tokenizer", "spm.model"), "ab") as f:
        f.write(b"changed")  # a tokenizer not the export's
    with pytest.raises(ConfigError, match=r"another run .*\(its tokenizer has sha256 "):
        _translate_with(other, export_dir, output_path=str(tmp_path / "out.txt"))


def test_export_out_under_a_file_is_one_line_before_restoring(workdir, tmp_path, monkeypatch):
    (tmp_path / "afile.txt").write_text("mine")
    monkeypatch.setattr("transformer_jax.checkpoints.restore.restore_workdir",
                        lambda *a: pytest.fail("restored before the --out check"))
    with pytest.raises(ConfigError) as error:
        ctranslate2_engine.export_workdir(workdir, out_dir=str(tmp_path / "afile.txt" / "sub"))
    assert str(error.value) == (f"--out={tmp_path / 'afile.txt' / 'sub'}: {tmp_path / 'afile.txt'} is a "
                                "file, not a folder; choose another --out")


def test_translate_names_its_own_flag_for_an_export_dir_it_cannot_make(workdir, tmp_path):
    """translate makes a missing export in --export_dir; what stops it names --export_dir (it has no
    --out)."""
    (tmp_path / "afile.txt").write_text("mine")
    (tmp_path / "in.txt").write_text(SENTENCES)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    for export_dir, expected in (
            (tmp_path / "afile.txt" / "sub", f"{tmp_path / 'afile.txt'} is a file, not a folder; choose "
                                             "another --export_dir"),
            (notes, "exists and is not an export; choose a new or empty folder")):
        with pytest.raises(ConfigError) as error:
            workdir_scoring.translate_workdir(workdir, input_path=str(tmp_path / "in.txt"),
                                              engine="ctranslate2", export_dir=str(export_dir), beam_size=1)
        assert str(error.value).startswith(f"--export_dir={export_dir}")
        assert str(error.value).endswith(expected) and "--out" not in str(error.value)


def test_an_export_that_fills_the_disk_names_its_filesystem(workdir, tmp_path, monkeypatch):
    """The save fails with ENOSPC and no file name (as CTranslate2's writes do): the error names the
    export's filesystem, not the current directory's, and the previous export is kept."""
    out_dir = _exported_copy(workdir, tmp_path)
    before = sorted(os.listdir(out_dir))
    from ctranslate2.specs import transformer_spec

    def full(self, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformer_spec.TransformerSpec, "save", full)
    with pytest.raises(DiskFullError) as error:
        ctranslate2_engine.export_workdir(workdir, out_dir=out_dir)
    assert str(error.value).startswith(f"no space left writing the export to {out_dir}: the ")
    assert f"filesystem mounted at {disk.mount_point(out_dir)} (" in str(error.value)
    assert "the previous export there is kept" in str(error.value)
    assert sorted(os.listdir(out_dir)) == before and sorted(os.listdir(tmp_path)) == ["export"]


@pytest.mark.parametrize("renames, left", [(1, [".old", ".tmp"]), (2, [".old"])])
def test_an_export_killed_between_its_renames_is_cleaned_up(workdir, tmp_path, renames, left):
    """kill -9 after the previous export was moved aside (``<out>.<pid>.old``; the new one still staged in
    ``<out>.<pid>.tmp``, or already in place): translate puts the previous export back when there is no
    other, and removes the rest; nothing is left for good."""
    out_dir = _exported_copy(workdir, tmp_path)
    killed = subprocess.run([sys.executable, "-c", f"""
import os
from transformer_jax.evaluation import ctranslate2_engine
rename, calls = os.rename, []
def rename_then_die(a, b):
    rename(a, b)
    calls.append(b)
    if len(calls) == {renames}:
        os.kill(os.getpid(), 9)
os.rename = rename_then_die
ctranslate2_engine.export_workdir({workdir!r}, out_dir={out_dir!r})
"""], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    leftovers = sorted(name for name in os.listdir(tmp_path) if name.startswith("export."))
    assert [os.path.splitext(name)[1] for name in leftovers] == left
    _translate_with(workdir, out_dir, output_path=str(tmp_path / "out.txt"))  # reads the new one
    assert sorted(os.listdir(tmp_path)) == ["export", "in.txt", "out.txt"]


def _leftover(path, pid: int, *, marked: bool = True, folder: str | None = None) -> None:
    """A folder ``path`` as an exporter of ``pid`` leaves it (its marker naming the pid and the folder,
    ``folder`` for a copy made of another), or a user's folder without a marker."""
    path.mkdir()
    (path / "export.json").write_text("{}")
    if marked:
        maker = {"pid": pid, "host": socket.gethostname(), "folder": folder or path.name}
        (path / ctranslate2_engine.MARKER_FILE).write_text(json.dumps(maker))


def test_recover_leftovers_puts_back_a_previous_export_a_killed_exporter_moved_aside(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    _leftover(tmp_path / f"export.{dead.pid}.old", dead.pid)
    _leftover(tmp_path / f"export.{dead.pid}.tmp", dead.pid)
    _leftover(tmp_path / f"export.{os.getpid()}.tmp", os.getpid())  # a live exporter's: left alone
    ctranslate2_engine.recover_leftovers(str(tmp_path / "export"))
    assert sorted(os.listdir(tmp_path)) == ["export", f"export.{os.getpid()}.tmp"]
    assert (tmp_path / "export" / "export.json").read_text() == "{}"


def test_a_users_folders_beside_the_export_are_never_touched(workdir, tmp_path):
    """A backup named like a leftover (``<export>.<digits>.old``, no process of that pid runs), a copy of a
    killed exporter's folder under another number, one without a marker, and a copy of an export made by
    a process now gone, named ``<export>.<pid in its marker>.old``: neither cleaned up nor renamed into
    place when the export is missing; translate makes a new export instead."""
    dead, gone = subprocess.Popen(["true"]), subprocess.Popen(["true"])
    dead.wait()
    gone.wait()
    export_dir = tmp_path / "export"
    _leftover(tmp_path / "export.20261206.old", 20261206, marked=False)  # the user's backup
    _leftover(tmp_path / f"export.{dead.pid}.old", dead.pid, marked=False)  # a pid that does not run
    _leftover(tmp_path / f"export.{dead.pid + 1}.tmp", dead.pid)  # a copy: its marker names another pid
    # A copy of an export: its marker names the exporter's (gone) pid and the folder it was staged in.
    _leftover(tmp_path / f"export.{gone.pid}.old", gone.pid, folder=f"export.{gone.pid}.tmp")
    users = sorted(os.listdir(tmp_path))
    ctranslate2_engine.recover_leftovers(str(export_dir))
    assert sorted(os.listdir(tmp_path)) == users and not export_dir.exists()
    _translate_with(workdir, str(export_dir), output_path=str(tmp_path / "out.txt"))  # exports first
    assert sorted(os.listdir(tmp_path)) == sorted([*users, "export", "in.txt", "out.txt"])
    assert ctranslate2_engine.read_record(str(export_dir))["step"] == 2
    for name in users:
        assert (tmp_path / name / "export.json").read_text() == "{}"


def test_threads_are_bounded_by_the_cpus(workdir, tmp_path):
    with pytest.raises(ConfigError, match=r"--threads=100000: expected at most \d+ "):
        workdir_scoring.translate_workdir(workdir, engine="ctranslate2", threads=100000)  # crashed it
    limit = ctranslate2_engine.MAX_THREADS_PER_CPU * os.cpu_count()
    for threads in (limit + 1, 5000):
        with pytest.raises(ConfigError) as error:
            workdir_scoring.translate_workdir(workdir, engine="ctranslate2", threads=threads)
        assert str(error.value).startswith(f"--threads={threads}: expected at most {limit} (")
        with pytest.raises(ConfigError, match=rf"--threads={threads}: expected at most {limit} \("):
            workdir_scoring.evaluate_workdir(workdir, engine="ctranslate2", threads=threads,
                                             output_dir=str(tmp_path))


def test_an_export_to_a_full_tmpfs_names_the_tmpfs(workdir, tmp_path):
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a small tmpfs needs root")
    point = tmp_path / "small"
    point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(point)]).returncode != 0:
        pytest.skip("mount -t tmpfs is not allowed here")
    try:
        (point / "filler").write_bytes(bytes(2 * 2**20 - 48 * 1024))  # 48 KiB left; the export takes ~100
        with pytest.raises(DiskFullError) as error:
            ctranslate2_engine.export_workdir(workdir, out_dir=str(point / "export"))
        out_dir = point / "export"
        assert str(error.value).startswith(
            f"no space left writing the export to {out_dir}: the tmpfs filesystem mounted at {point} (")
        assert os.listdir(point) == ["filler"]  # the partial export was removed
    finally:
        subprocess.run(["umount", str(point)])
