"""Tests for evaluation/translation.py and the translate command: batch plans, equality with one-batch
decoding, empty and too-long lines, and the CLI end to end on a tiny workdir."""

import errno
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from tiny import TRAIN, config_with, random_params, untrained_workdir

from transformer_jax import data as data_lib
from transformer_jax.checkpoints import restore
from transformer_jax.data import eval_batches
from transformer_jax.evaluation import decode, scoring, translation, workdir_scoring
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.runtime import disk, errors
from transformer_jax.runtime.errors import ConfigError, DataError, DiskFullError
from transformer_jax.runtime.output_file import OutputFile

VOCAB = 29
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model_config(max_len=40, position_encoding="sinusoidal"):
    return ModelConfig(vocab_size=VOCAB, d_model=15, d_ff=17, num_heads=3, d_k=5, d_v=7,
                       num_encoder_layers=1, num_decoder_layers=2, dropout_rate=0.0, max_len=max_len,
                       position_encoding=position_encoding)


def _sentences(seed, n, max_tokens):
    """n int32 id arrays of 1..max_tokens tokens, each ending with EOS (as ``source_ids`` makes them)."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(4, VOCAB, size=rng.integers(0, max_tokens)), EOS_ID).astype(np.int32)
            for _ in range(n)]


def _one_batch(ids):
    """int32[n, longest]: every sentence in one PAD-padded batch, in input order."""
    out = np.full((len(ids), max(map(len, ids))), PAD_ID, np.int32)
    for r, s in enumerate(ids):
        out[r, :len(s)] = s
    return out


# --------------------------------------------------------------------------------------------------
# Batch plans.


def _plan(lengths, beams, extra, budget, max_src_len=None):
    """decode_ids' batches: the one planner with the decoding buckets and rows."""
    settings = translation.Settings(beams, 0.6, extra)
    buckets, sizes = translation.decode_buckets(max(lengths, default=0), settings, budget, max_src_len)
    return eval_batches.plan_batches(lengths, buckets, sizes, round_partial=True)


# Translation (greedy; the paper's beam 4, input + 50) and parsing (beam 21, input + 300; greedy dev F1).
@pytest.mark.parametrize("beams,extra,budget", [(1, 3, 700), (5, 50, 96 * 1024), (4, 0, 3000),
                                                (21, 300, 192 * 1024), (21, 300, 24 * 1024),
                                                (1, 300, 192 * 1024)])
def test_plan_covers_every_sentence_once_sorted_and_within_budget(beams, extra, budget):
    lengths = np.random.default_rng(3).integers(1, 90, size=1001)
    batches = _plan(lengths, beams, extra, budget)
    covered = np.concatenate([b.indices for b in batches])
    assert sorted(covered.tolist()) == list(range(1001))  # each exactly once
    src_lens = [b.length for b in batches]
    assert src_lens == sorted(src_lens)
    step = 32 if extra == 300 else 8
    for k, b in enumerate(batches):
        assert lengths[b.indices].max() <= b.length
        assert b.length % (step if b.length <= 64 else 8) == 0 or b.length == lengths.max()
        assert len(b.indices) <= b.rows
        assert beams * b.rows * (b.length + extra) <= budget or b.rows == 1
        assert b.rows % 8 == 0 or b.rows < 8 or k == len(batches) - 1
        if k < len(batches) - 1:  # only the last batch has padding rows
            assert len(b.indices) == b.rows
    last = batches[-1]  # rounded up to few sizes, at most a full batch
    assert len(last.indices) <= last.rows <= eval_batches.padded_rows(len(last.indices))


def test_default_budget_is_a_fixed_cache_size():
    """4 KiB a cached position for the Multi30k model (4 layers x 4 heads x (32 + 32) float32), 24 KiB
    for the base model (6 x 8 x (64 + 64)), 12 KiB for it in bfloat16."""
    multi30k = ModelConfig(vocab_size=8000, d_model=128, d_ff=256, num_heads=4, num_encoder_layers=4,
                           num_decoder_layers=4)
    base = ModelConfig(vocab_size=32000)
    assert translation.default_tokens_per_batch(multi30k) == 192 * 1024
    assert translation.default_tokens_per_batch(base) == 32 * 1024
    assert translation.default_tokens_per_batch(base.replace(dtype="bfloat16")) == 64 * 1024


def test_padded_rows_are_four_sizes_an_octave():
    rows = [eval_batches.padded_rows(n) for n in range(1, 300)]
    assert [eval_batches.padded_rows(n) for n in (1, 3, 5, 8, 9, 17, 25, 33, 129, 144, 161, 257)] == [
        1, 4, 8, 8, 16, 24, 32, 40, 160, 160, 192, 320]
    assert all(n <= r and (r <= 8 or (r % 8 == 0 and r < 1.25 * n + 8)) for n, r in enumerate(rows, start=1))
    assert len(set(r for r in rows if 128 < r <= 256)) == 4


def test_plan_of_one_sentence_is_one_row_and_of_none_is_empty():
    (batch,) = _plan([5], 4, 50, 96 * 1024)
    assert (batch.rows, batch.length, batch.indices.tolist()) == (1, 8, [0])
    assert _plan([], 4, 50, 96 * 1024) == []
    capped = _plan([5, 9, 11], 1, 3, 96 * 1024, max_src_len=11)
    # One batch (too few to fill a batch at length 8), never padded beyond the position table.
    assert [(b.length, b.rows) for b in capped] == [(11, 4)]


def test_parsing_plan_compiles_fewer_shapes_than_padding_to_multiples_of_16():
    """Beam 21 over input + 300 on WSJ-like lengths: lengths step by 32 up to 64, so fewer shapes than
    the 16-token grid parsing used before, each within the same budget."""
    lengths = np.clip(np.random.default_rng(4).normal(25, 11, size=2416).round(), 1, 80).astype(int)
    batches = _plan(lengths, 21, 300, 192 * 1024)
    shapes = {(b.length, b.rows) for b in batches}
    assert len(shapes) <= len({-(-n // 16) for n in lengths})
    assert {b.length for b in batches} <= {32, 64, 80}


def test_rows_are_a_multiple_of_8_or_what_fits():
    assert translation.batch_rows(192 * 1024, 5, 114) == 344  # 344.9 -> a multiple of 8
    assert translation.batch_rows(24 * 1024, 21, 364) == 3  # too few for 8: what fits
    assert translation.batch_rows(100, 21, 364) == 1  # never none


# --------------------------------------------------------------------------------------------------
# Same outputs as the present decoder on one batch holding every sentence.


def test_greedy_decode_ids_equals_greedy_search_of_one_batch_exactly():
    cfg, ids = _model_config(), _sentences(0, 37, 20)
    params = random_params(cfg, seed=1)
    settings = translation.Settings(beam_size=1, max_extra_len=5)
    got = translation.decode_ids(params, cfg, ids, settings, tokens_per_batch=8 * 30)  # several batches
    assert len(_plan([len(s) for s in ids], 1, 5, 8 * 30)) >= 3
    expected = np.asarray(decode.greedy_search(params, cfg, _one_batch(ids), max_extra_len=5))
    for i, (g, s) in enumerate(zip(got, ids, strict=True)):
        assert g.shape == (len(s) + 5,)
        np.testing.assert_array_equal(g, expected[i, :len(s) + 5], err_msg=f"sentence {i}")
        assert np.all(expected[i, len(s) + 5:] == PAD_ID)  # nothing lost by trimming to the limit


def test_beam_decode_ids_gives_the_hypotheses_of_beam_search_of_one_batch():
    cfg, ids = _model_config(), _sentences(1, 23, 14)
    params = random_params(cfg, seed=2)
    settings = translation.Settings(beam_size=3, alpha=0.6, max_extra_len=4)
    got = translation.decode_ids(params, cfg, ids, settings, tokens_per_batch=3 * 8 * 20)
    expected, _ = decode.beam_search(params, cfg, _one_batch(ids), beam_size=3, alpha=0.6, max_extra_len=4)
    for i, (g, s) in enumerate(zip(got, ids, strict=True)):
        np.testing.assert_array_equal(g, np.asarray(expected)[i, :len(s) + 4], err_msg=f"sentence {i}")


def test_evaluation_path_is_decode_ids():
    """scoring.translate (evaluate.py, dev BLEU) gives the texts of decode_ids on the real rows."""
    cfg, ids = _model_config(), _sentences(2, 9, 10)
    params = random_params(cfg, seed=3)
    inputs = _one_batch(ids + [np.asarray([EOS_ID])] * 2)  # two padding rows beyond num_real
    inputs[9:] = PAD_ID
    batch = data_lib.EvalBatch(inputs, inputs, [""] * 9, [""] * 9, np.arange(9)[::-1].copy(), 9)

    class Digits:
        def decode_batch(self, rows):
            return [" ".join(str(int(i)) for i in row if i != PAD_ID) for row in rows]

    got = scoring.translate(params, cfg, Digits(), [batch], beam_size=2, alpha=1.0, max_extra_len=3)
    outputs = translation.decode_ids(params, cfg, ids, translation.Settings(2, 1.0, 3))
    assert got == Digits().decode_batch(outputs)[::-1]  # rows are put back in split order


# --------------------------------------------------------------------------------------------------
# Text in, text out.


class _CharTokenizer:
    """One token per character (ids 4 + ord % 25), decoded back to letters."""

    def encode_text(self, texts, *, side):
        assert side == "source"
        return [[4 + ord(c) % 25 for c in t] for t in texts]

    def decode_batch(self, rows):
        texts = []
        for row in rows:
            row = list(np.asarray(row))
            row = row[:row.index(EOS_ID)] if EOS_ID in row else row
            texts.append("".join(chr(ord("a") + int(i) - 4) for i in row if i >= 4))
        return texts


def test_translate_texts_keeps_order_and_empty_lines():
    cfg = _model_config()
    params = random_params(cfg, seed=4)
    texts = ["abc de", "", "x", "   ", "a much longer line", "abc de"]
    settings = translation.Settings(beam_size=1, max_extra_len=3)
    got = translation.translate_texts(params, cfg, _CharTokenizer(), texts, settings)
    assert got[1] == "" and got[3] == "" and len(got) == 6
    assert got[0] == got[5]  # same sentence, same output, wherever it sits
    alone = [translation.translate_texts(params, cfg, _CharTokenizer(), [t], settings)[0] for t in texts]
    assert got == alone
    seen = []
    translation.translate_texts(params, cfg, _CharTokenizer(), texts, settings, progress=seen.append)
    assert sum(seen) == len(texts)


def test_too_long_line_is_an_error_naming_it_unless_truncate():
    # The learned table of 12 positions holds 12 - 3 = 9 source tokens, EOS included.
    cfg = _model_config(max_len=12, position_encoding="learned")
    params = random_params(cfg, seed=5)
    settings = translation.Settings(beam_size=1, max_extra_len=3)
    texts = ["short", "", "exactly8", "ninechars"]  # 9 and 10 tokens with EOS
    with pytest.raises(DataError, match=r"in\.txt:4: 10 tokens .*more than the 9.*--truncate"):
        translation.translate_texts(params, cfg, _CharTokenizer(), texts, settings,
                                    locations=[f"in.txt:{i + 1}" for i in range(4)])
    got = translation.translate_texts(params, cfg, _CharTokenizer(), texts, settings, truncate=True)
    cut = translation.translate_texts(params, cfg, _CharTokenizer(), ["ninechar"], settings)
    assert got[3] == cut[0]  # cut to 8 tokens + EOS


def test_read_lines_keeps_empty_lines_and_drops_the_final_line_end(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"one\n\ntwo\r\nthree\n")
    assert translation.read_lines(str(path)) == ["one", "", "two", "three"]
    path.write_bytes(b"no final newline")
    assert translation.read_lines(str(path)) == ["no final newline"]


# --------------------------------------------------------------------------------------------------
# The command, on a workdir of an untrained tiny model.

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A train.py-shaped workdir without training: a tokenizer and checkpoint 1 of the initial state."""
    workdir = str(tmp_path_factory.mktemp("workdir"))
    untrained_workdir(config_with(TRAIN), workdir)
    return workdir


def _run(args, stdin=""):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "transformer_jax.translate", *args], input=stdin,
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def _error_line(result):
    """The one ``error:`` line of a failed command's stderr (absl may log warnings before it)."""
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    return line


# Lines and search of the commands that decode: one compiled search, which the later ones find in the
# compilation cache.
LINES = ["the first sentence", "", "a second one, longer than the first one", "third"]
SEARCH = ["--beam_size=2", "--max_extra_len=4"]


def test_translate_command_reads_stdin_and_writes_translations_in_order(workdir, tmp_path):
    result = _run([f"--workdir={workdir}", *SEARCH, "--stats"], "\n".join(LINES) + "\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout.split("\n")
    assert len(out) == 5 and out[-1] == "" and out[1] == ""  # one line per input line
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    assert stats["num_sentences"] == 4 and stats["sentences_per_second"] > 0
    restored = restore.restore_workdir(workdir)
    expected = translation.translate_texts(restored.params, restored.model_config, restored.tokenizer,
                                           LINES, translation.Settings(2, restored.run.eval.final_alpha, 4))
    assert out[:4] == expected
    # --input / --output give the same text.
    (tmp_path / "in.txt").write_text("\n".join(LINES) + "\n")
    result = _run([f"--workdir={workdir}", *SEARCH, f"--input={tmp_path / 'in.txt'}",
                   f"--output={tmp_path / 'out.txt'}"])
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.txt").read_text().split("\n")[:4] == expected


@pytest.fixture(scope="module")
def learned_workdir(tmp_path_factory):
    """As ``workdir``, with a learned position table: the one scheme that bounds a line's length."""
    workdir = str(tmp_path_factory.mktemp("learned"))
    untrained_workdir(config_with({**TRAIN, "model.position_encoding": "learned"}), workdir)
    return workdir


def test_translate_command_names_a_too_long_line_in_one_error_line(learned_workdir, tmp_path):
    workdir = learned_workdir
    (tmp_path / "in.txt").write_text("fine\n" + "word " * 400 + "\n")
    result = _run([f"--workdir={workdir}", f"--input={tmp_path / 'in.txt'}"])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    line = _error_line(result)
    assert line.startswith(f"error: {tmp_path / 'in.txt'}:2: ") and "tokens (EOS included)" in line
    assert "learned position table has model.max_len=256 positions" in line
    result = _run([f"--workdir={workdir}", f"--input={tmp_path / 'in.txt'}", "--truncate", "--beam_size=1",
                   "--max_extra_len=2"])
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split("\n")) == 3


def test_translate_command_rejects_bad_flags_in_one_line(workdir, tmp_path):
    result = _run([f"--workdir={workdir}", "--beam_size=0"])
    assert result.returncode == 1
    assert _error_line(result).startswith("error: --beam_size=0: expected an integer >= 1")
    result = _run([f"--workdir={tmp_path / 'nowhere'}"])
    assert result.returncode == 1 and "no such directory" in _error_line(result)
    result = _run([f"--workdir={workdir}", f"--input={tmp_path / 'missing.txt'}"])
    assert result.returncode == 1 and "missing.txt: no such file" in _error_line(result)


def _run_bytes(args, stdin: bytes = b"", stdout=subprocess.PIPE):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "transformer_jax.translate", *args], input=stdin,
                          stdout=stdout, stderr=subprocess.PIPE, cwd=REPO, env=env, timeout=300)


def _only_error_line(result) -> str:
    """The ``error:`` line of a failed command, which must be followed by the hint alone."""
    lines = [x for x in result.stderr.decode().splitlines() if x.strip() and not x.startswith(("W", "I"))]
    assert result.returncode == 1 and "Traceback" not in result.stderr.decode(), result.stderr.decode()
    assert len(lines) == 2 and lines[0].startswith("error: "), lines
    return lines[0]


def test_bad_bytes_are_one_line_naming_the_line(workdir, tmp_path):
    line = _only_error_line(_run_bytes([f"--workdir={workdir}"], b"fine\na \xff b\n"))
    assert line == ("error: <stdin>:2: byte 0xff at column 3 is not UTF-8; convert the file to UTF-8 (e.g. "
                    "iconv -f latin1 -t utf-8)")
    (tmp_path / "bad.en").write_bytes("caf\u00e9\n".encode("latin-1"))
    line = _only_error_line(_run_bytes([f"--workdir={workdir}", f"--input={tmp_path / 'bad.en'}"]))
    assert line.startswith(f"error: {tmp_path / 'bad.en'}:1: byte 0xe9 at column 4 is not UTF-8")
    (tmp_path / "binary.en").write_bytes(b"\x7fELF\x02\x01\x00\x00\n")
    line = _only_error_line(_run_bytes([f"--workdir={workdir}", f"--input={tmp_path / 'binary.en'}"]))
    assert line.startswith(f"error: {tmp_path / 'binary.en'}:1: a NUL byte")


def test_the_output_path_is_checked_before_decoding(workdir, tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text("a sentence\n")
    args = [f"--workdir={workdir}", f"--input={tmp_path / 'in.txt'}"]
    line = _only_error_line(_run_bytes([*args, f"--output={tmp_path / 'nosuchdir' / 'out.de'}"]))
    assert line == (f"error: --output={tmp_path / 'nosuchdir' / 'out.de'}: the folder "
                    f"{tmp_path / 'nosuchdir'} does not exist; create it first")
    line = _only_error_line(_run_bytes([*args, f"--output={tmp_path}"]))
    assert line.startswith(f"error: --output={tmp_path} is a folder; expected a file path")
    # Nothing is restored or decoded first: the same errors come before a workdir is even read.
    calls = []
    monkeypatch.setattr(workdir_scoring, "restore_workdir", lambda *a, **k: calls.append(a))
    with pytest.raises(ConfigError, match="does not exist"):
        workdir_scoring.translate_workdir(workdir, input_path=str(tmp_path / "in.txt"),
                                      output_path=str(tmp_path / "nosuchdir" / "out.de"))
    assert calls == []


def test_a_failed_translation_keeps_the_previous_output_and_leaves_no_temporary_file(learned_workdir,
                                                                                       tmp_path):
    (tmp_path / "out.de").write_text("the previous translations\n")
    (tmp_path / "in.txt").write_text("fine\n" + "word " * 400 + "\n")  # line 2 is too long: an error
    result = _run_bytes([f"--workdir={learned_workdir}", f"--input={tmp_path / 'in.txt'}",
                         f"--output={tmp_path / 'out.de'}"])
    assert "tokens (EOS included)" in _only_error_line(result)
    assert (tmp_path / "out.de").read_text() == "the previous translations\n"
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "out.de"]


def test_output_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "out.de"
    target.write_text("old\n")
    (tmp_path / ".out.de.999999999.tmp").write_text("left by a run killed with -9")  # no such process
    with OutputFile(str(target)) as out:
        assert len(os.listdir(tmp_path)) == 2  # the temporary file, beside the target
        out.write("new\n")
    assert target.read_text() == "new\n" and os.listdir(tmp_path) == ["out.de"]

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DiskFullError) as error, OutputFile(str(target)) as out:
        out.write("newer\n")
    assert str(error.value).startswith(f"no space left writing --output={target}: the ")
    assert disk.mount_point(str(target)) in str(error.value)
    assert target.read_text() == "new\n" and os.listdir(tmp_path) == ["out.de"]


def test_a_full_stdout_is_one_line(workdir):
    with open("/dev/full", "wb") as full:
        result = _run_bytes([f"--workdir={workdir}", *SEARCH, "--noprogress"],
                            ("\n".join(LINES) + "\n").encode(), stdout=full)
    line = _only_error_line(result)
    assert line.startswith("error: no space left writing to standard output (/dev/full)")


def test_translate_refuses_a_parsing_workdir(tmp_path):
    parsing = str(tmp_path / "parsing")
    untrained_workdir(config_with({**TRAIN, "data.source": "synthetic_trees"}), parsing)
    line = _only_error_line(_run_bytes([f"--workdir={parsing}"], b"a sentence\n"))
    assert line == (f"error: --workdir={parsing} is a parsing run; translate decodes translation runs. "
                    f"Parse with: python evaluate.py --workdir={parsing} (trees over the input words)")


def test_throughput_benchmark_reports_the_translate_path_on_a_file(workdir, tmp_path, capsys):
    from transformer_jax.benchmarks import decoding

    lines = ["one sentence", "", "another, longer sentence here", "x"]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    [record] = decoding.bench_throughput(str(tmp_path / "in.txt"), workdir, num_sentences=3, beam_size=2,
                                         repeats=1)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    assert record["num_sentences"] == 3 and record["beam_size"] == 2
    restored = restore.restore_workdir(workdir)
    outputs = translation.translate_texts(restored.params, restored.model_config, restored.tokenizer,
                                          lines[:3], translation.Settings(2, restored.run.eval.final_alpha,
                                                                          restored.run.eval.final_max_extra_len))
    assert record["target_tokens"] == sum(map(len, restored.tokenizer.encode_batch(outputs)))
    assert record["sentences_per_s"] == pytest.approx(3 / record["median_s"], rel=0.02)


def test_an_output_that_is_the_input_is_refused_and_the_input_kept(workdir, tmp_path, monkeypatch):
    source = tmp_path / "in.txt"
    source.write_text("a sentence\nanother\n")
    os.symlink(source, tmp_path / "link.txt")
    os.link(source, tmp_path / "hard.txt")
    for output in (source, tmp_path / "link.txt", tmp_path / "hard.txt"):
        with pytest.raises(ConfigError) as error:
            workdir_scoring.translate_workdir(workdir, input_path=str(source), output_path=str(output),
                                              beam_size=1, max_extra_len=2)
        assert str(error.value) == (f"--output={output} is the input file (--input={source}); writing there "
                                    "would replace the input. Choose another --output")
    with open(source) as stdin:  # translate --output=in.txt < in.txt
        monkeypatch.setattr(sys, "stdin", stdin)
        with pytest.raises(ConfigError, match=r"is the input file \(standard input\)"):
            workdir_scoring.translate_workdir(workdir, output_path=str(source), beam_size=1, max_extra_len=2)
    assert source.read_text() == "a sentence\nanother\n" and os.path.islink(tmp_path / "link.txt")
    assert sorted(os.listdir(tmp_path)) == ["hard.txt", "in.txt", "link.txt"]  # no temporary file left


def test_a_named_pipe_and_dev_stdin_are_inputs(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"printf 'one\\ntwo\\n' > {fifo}"])
    assert translation.read_lines(str(fifo)) == ["one", "two"]
    assert writer.wait(timeout=30) == 0
    read = subprocess.run(
        [sys.executable, "-c", "from transformer_jax.evaluation.translation import read_lines; "
         "print(read_lines('/dev/stdin'))"], input="three\nfour\n", capture_output=True, text=True,
        cwd=REPO, timeout=120)
    assert read.returncode == 0, read.stderr
    assert read.stdout == "['three', 'four']\n"


# A process that writes 20,001 bytes through write_stdout to a file that fills up after 8 KiB: the size limit
# RLIMIT_FSIZE (no root needed; the write then fails with EFBIG instead of a signal) or a small tmpfs. The
# kernel takes such a write only in part.
_FILL_STDOUT = """import sys
if {limit}:
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
sys.path.insert(0, {repo!r})
from transformer_jax.runtime import errors, output_file
errors.run_main(lambda argv: output_file.write_stdout("x" * 20000 + "\\n"))
"""


def _write_20000_bytes_to(path, limit_bytes=0):
    with open(path, "wb") as out:
        return subprocess.run([sys.executable, "-c", _FILL_STDOUT.format(limit=limit_bytes, repo=REPO)],
                              stdout=out, stderr=subprocess.PIPE, text=True, timeout=120)


def test_stdout_to_a_file_that_fills_up_is_an_error_not_a_cut_file(tmp_path):
    result = _write_20000_bytes_to(tmp_path / "out.txt", limit_bytes=8192)
    assert os.path.getsize(tmp_path / "out.txt") == 8192
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[0] == (
        f"error: could not write to standard output ({tmp_path / 'out.txt'}) (File too large); the output "
        "is incomplete. Pass --output to write a file whole or not at all")


def test_stdout_to_a_full_tmpfs_is_an_error_not_a_cut_file(tmp_path):
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    point = tmp_path / "small"
    point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(point)]).returncode != 0:
        pytest.skip("mount -t tmpfs is not allowed here")
    try:
        (point / "filler").write_bytes(bytes(56 * 1024))  # 8 KiB left
        result = _write_20000_bytes_to(point / "out.txt")
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.splitlines()[0].startswith(
            f"error: no space left writing to standard output ({point / 'out.txt'}); the output is "
            "incomplete")
    finally:
        subprocess.run(["umount", str(point)])


def test_translate_and_evaluate_check_a_flag_with_the_same_words(workdir, tmp_path):
    from transformer_jax.evaluation import evaluate_args

    for flag, value in (("beam_size", 0), ("alpha", -0.5), ("max_extra_len", 2.5)):
        with pytest.raises(ConfigError) as translate_error:
            workdir_scoring.translate_workdir(workdir, **{flag: value})
        with pytest.raises(ConfigError) as evaluate_error:
            evaluate_args.check_arguments(workdir, **{"step": None, "average_last": 1, "split": "dev",
                                                      "source_file": None, "reference_file": None,
                                                      "beam_size": None, "alpha": None, "max_extra_len": None,
                                                      "output_dir": str(tmp_path), flag: value})
        assert str(translate_error.value) == str(evaluate_error.value)


def test_ctrl_c_is_one_line_and_keeps_the_previous_output(workdir, tmp_path):
    """SIGINT while translate waits for its input (the output's temporary file made): one line, exit
    status 130, the previous --output kept and no temporary file left."""
    (tmp_path / "out.de").write_text("the previous translations\n")
    proc = subprocess.Popen([sys.executable, "-m", "transformer_jax.translate", f"--workdir={workdir}",
                             f"--output={tmp_path / 'out.de'}"], stdin=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    deadline = time.time() + 120
    while len(os.listdir(tmp_path)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]  # closes stdin too: an ignored signal would translate ""
    assert proc.returncode == errors.INTERRUPTED_EXIT_STATUS == 130, stderr
    assert stderr.splitlines() == ["Stopped by SIGINT (Ctrl-C); nothing was written (the output is written "
                                   "whole at the end). Run the same command again to translate."]
    assert os.listdir(tmp_path) == ["out.de"] and (tmp_path / "out.de").read_text() == (
        "the previous translations\n")
