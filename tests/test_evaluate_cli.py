"""evaluate.py end to end on a copy of the shared tiny trained workdir (``tiny.TRAINED``: checkpoints 2, 4
and 6, final_average_last=3): --split, --source_file/--reference_file, --average_last, --output_dir and
--overwrite, and the errors found before anything is decoded."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from tiny import TRAIN, TRAINED, config_with, untrained_workdir

from transformer_jax import data as data_lib
from transformer_jax.evaluation import workdir_scoring
from transformer_jax.runtime import provenance
from transformer_jax.runtime.errors import ConfigError, DataError, MissingFileError, UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABSL_LOG_LINE = re.compile(r"[IWEF]\d{4} ")  # library log lines (orbax), not the error itself
FAST = ["--beam_size=1", "--max_extra_len=4"]  # greedy, short outputs: the tiny model is not the point


NUM_DEV = TRAINED["data.synthetic_dev_size"]


@pytest.fixture(scope="module")
def workdir(trained_run, tmp_path_factory):
    """A copy of the shared 6-step run (checkpoints 2, 4 and 6; its final model averages all three), which
    these tests write their results into; its synthetic test pairs."""
    path = str(tmp_path_factory.mktemp("evaluate_cli") / "run")
    shutil.copytree(trained_run[0], path)
    return path, list(data_lib.get_source(config_with(TRAINED).data).pairs("test"))


def _evaluate(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "evaluate.py"), *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _write_pair(folder, name: str, pairs, src="en", tgt="de") -> tuple[str, str]:
    paths = (os.path.join(folder, f"{name}.{src}"), os.path.join(folder, f"{name}.{tgt}"))
    for path, side in zip(paths, zip(*pairs, strict=True), strict=True):
        with open(path, "w") as f:
            f.writelines(line + "\n" for line in side)
    return paths


def test_split_scores_the_runs_final_average_by_default(workdir):
    path, _ = workdir
    result = _evaluate(f"--workdir={path}", "--split=dev", *FAST)
    assert result.returncode == 0, result.stderr
    with open(os.path.join(path, "eval", "dev-6-avg3.json")) as f:
        written = json.load(f)
    assert (written["split"], written["step"], written["num_sentences"]) == ("dev", 6, NUM_DEV)
    assert (written["average_last"], written["averaged_steps"]) == (3, [2, 4, 6])
    with open(os.path.join(path, "eval", "dev-6-avg3.txt")) as f:
        assert len(f.read().splitlines()) == NUM_DEV
    assert json.loads(result.stdout.split("\n\n")[0])["sacrebleu"] == written["sacrebleu"]
    assert result.stdout.strip().splitlines()[-1] == (
        "scored the mean of the 3 checkpoints at steps 2, 4, 6 (the run's final_average_last=3)")
    # Where it was scored and where it was trained, in the numbers and under the paper's table.
    with open(os.path.join(path, provenance.FILENAME)) as f:
        assert written["run_provenance"] == json.load(f)
    scored_on = written["provenance"]
    assert scored_on["matmul_peak"] == "unknown: evaluate.py measures no matmul peak"
    assert scored_on["config_sha256"] == written["run_provenance"]["first"]["config_sha256"]
    assert f"scored on {provenance.describe(scored_on)}" in result.stdout.splitlines()
    assert f"trained on {provenance.describe(written['run_provenance'])}" in result.stdout.splitlines()

    # The same command again refuses (before decoding) instead of replacing the result silently.
    again = _evaluate(f"--workdir={path}", "--split=dev", *FAST)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    assert len([line for line in again.stderr.splitlines() if not ABSL_LOG_LINE.match(line)]) == 2
    assert "dev-6-avg3.json exists" in again.stderr and "--overwrite" in again.stderr


def test_source_and_reference_files_name_the_outputs(workdir, tmp_path):
    path, pairs = workdir
    a_src, a_ref = _write_pair(tmp_path, "A", pairs[:3] + [("", "blank source: skipped")])
    b_src, b_ref = _write_pair(tmp_path, "B", pairs[3:5])
    out = tmp_path / "out"  # --output_dir: the workdir is left alone
    result = _evaluate(f"--workdir={path}", f"--source_file={a_src}", f"--reference_file={a_ref}",
                       f"--output_dir={out}", "--average_last=1", *FAST)
    assert result.returncode == 0, result.stderr
    assert "skipped 1 of 4 pairs with an empty side (lines 4)" in result.stderr  # shown, counted
    assert result.stdout.strip().splitlines()[-1] == (
        "scored the checkpoint at step 6 (no averaging: --average_last <= 1)")
    workdir_scoring.evaluate_workdir(path, source_file=b_src, reference_file=b_ref, output_dir=str(out),
                                     average_last=1, beam_size=1, max_extra_len=4)
    assert sorted(os.listdir(out)) == ["A.en-6.json", "A.en-6.txt", "B.en-6.json", "B.en-6.txt"]
    for name, count in (("A.en", 3), ("B.en", 2)):
        with open(out / f"{name}-6.json") as f:
            written = json.load(f)
        assert written["num_sentences"] == count and written["source_file"].endswith(name)
    assert not os.path.exists(os.path.join(path, "eval", "files-6.json"))


def test_average_last(workdir):
    path, _ = workdir
    settings = {"split": "test", "beam_size": 1, "max_extra_len": 4}
    single = workdir_scoring.evaluate_workdir(path, average_last=1, **settings)
    averaged = workdir_scoring.evaluate_workdir(path, average_last=2, **settings)
    assert [os.path.basename(p) for p in single["outputs"]] == ["test-6.txt", "test-6.json"]
    assert [os.path.basename(p) for p in averaged["outputs"]] == ["test-6-avg2.txt", "test-6-avg2.json"]
    assert averaged["average_last"] == 2 and averaged["step"] == single["step"] == 6
    assert averaged["ppl"] != pytest.approx(single["ppl"], rel=1e-6)  # other parameters were scored
    with pytest.raises(ConfigError, match=r"--average_last=4 needs 4 checkpoints .* found 3: \[2, 4, 6\]"):
        workdir_scoring.evaluate_workdir(path, split="test", average_last=4, beam_size=1)
    with pytest.raises(ConfigError, match=r"--average_last=-1"):
        workdir_scoring.evaluate_workdir(path, average_last=-1)
    # --overwrite replaces a result; without it the same call is refused.
    with pytest.raises(UserError, match=r"test-6\.json exists"):
        workdir_scoring.evaluate_workdir(path, average_last=1, **settings)
    again = workdir_scoring.evaluate_workdir(path, average_last=1, overwrite=True, **settings)
    assert again["ppl"] == pytest.approx(single["ppl"], rel=1e-6)


def test_a_line_too_long_to_decode_names_the_file_and_line(workdir, tmp_path):
    """Only a learned position table bounds a line (the shared run's sinusoid takes any length)."""
    _, pairs = workdir
    path = str(tmp_path / "learned")
    untrained_workdir(config_with({**TRAINED, "model.position_encoding": "learned"}), path, steps=(6,))
    long_line = " ".join([pairs[0][0]] * 200)  # far beyond model.max_len=256 minus 4 output positions
    src, ref = _write_pair(tmp_path, "long", [pairs[0], ("", ""), (long_line, pairs[1][1])])
    with pytest.raises(DataError, match=rf"{src}:3: the source has \d+ tokens .* more than the 252"):
        workdir_scoring.evaluate_workdir(path, source_file=src, reference_file=ref, beam_size=1,
                                    max_extra_len=4, output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=r"--max_extra_len=500: .* --max_extra_len=192 or less"):
        workdir_scoring.evaluate_workdir(path, max_extra_len=500, output_dir=str(tmp_path / "out"))


def test_an_unwritable_output_folder_fails_before_restoring(workdir, tmp_path):
    path, _ = workdir
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(UserError, match=r"cannot write the results to .*a_file/eval.*--output_dir"):
        workdir_scoring.evaluate_workdir(path, output_dir=str(blocker / "eval"))


def test_the_runs_final_average_equals_asking_for_it_and_average_last_1_scores_one_step(workdir, tmp_path):
    path, _ = workdir
    settings = {"split": "dev", "beam_size": 1, "max_extra_len": 4}
    default = workdir_scoring.evaluate_workdir(path, output_dir=str(tmp_path / "default"), **settings)
    explicit = workdir_scoring.evaluate_workdir(path, average_last=3, output_dir=str(tmp_path / "explicit"),
                                                **settings)
    assert default["averaged_steps"] == explicit["averaged_steps"] == [2, 4, 6]
    assert explicit["ppl"] == pytest.approx(default["ppl"], rel=1e-6)
    alone = workdir_scoring.evaluate_workdir(path, average_last=1, output_dir=str(tmp_path / "alone"),
                                             **settings)
    with open(tmp_path / "alone" / "dev-6.json") as f:
        single = json.load(f)
    assert single["averaged_steps"] == alone["averaged_steps"] == [6]
    assert single["ppl"] != pytest.approx(default["ppl"], rel=1e-6)


def test_the_default_average_names_its_source_when_too_few_checkpoints(workdir, tmp_path):
    path, _ = workdir
    with pytest.raises(ConfigError, match=(
            r"--average_last=3 \(the default: the run's final_average_last\) needs 3 checkpoints "
            r"up to step 2 .* found 1: \[2\]; pass --average_last=1 to score step 2 alone")):
        workdir_scoring.evaluate_workdir(path, step=2, beam_size=1, max_extra_len=4,
                                         output_dir=str(tmp_path / "out"))
    scored = workdir_scoring.evaluate_workdir(path, step=2, average_last=1, beam_size=1, max_extra_len=4,
                                              output_dir=str(tmp_path / "out"))
    assert scored["averaged_steps"] == [2]


def test_a_parsing_average_is_written_beside_the_single_checkpoint_result(tmp_path):
    """An averaged parsing score goes to <split>-<step>-avg<N>.*, as a translation one does, and the
    no-overwrite guard holds for it."""
    path = str(tmp_path / "parsing")
    untrained_workdir(config_with({**TRAIN, "data.source": "synthetic_trees", "data.synthetic_dev_size": 3}),
                      path, steps=(1, 2))
    settings = {"split": "dev", "beam_size": 1, "max_extra_len": 4}
    single = workdir_scoring.evaluate_workdir(path, average_last=1, **settings)
    averaged = workdir_scoring.evaluate_workdir(path, average_last=2, **settings)
    assert [os.path.basename(p) for p in single["outputs"]] == ["dev-2.txt", "dev-2.json"]
    assert [os.path.basename(p) for p in averaged["outputs"]] == ["dev-2-avg2.txt", "dev-2-avg2.json"]
    assert sorted(os.listdir(os.path.join(path, "eval"))) == [
        "dev-2-avg2.json", "dev-2-avg2.txt", "dev-2.json", "dev-2.txt"]
    with open(os.path.join(path, "eval", "dev-2.json")) as f:
        assert json.load(f)["average_last"] == 1  # not replaced by the average
    with pytest.raises(UserError, match=r"dev-2-avg2\.json exists"):
        workdir_scoring.evaluate_workdir(path, average_last=2, **settings)


def test_a_second_run_of_the_same_outputs_while_one_decodes_is_refused(workdir, tmp_path, monkeypatch):
    """Two evaluate.py runs of one workdir at once (beam 1 and beam 4, same split): the second arrives
    while the first decodes (here: from inside the first's perplexity pass, the step after it claimed its
    outputs) and is refused in one line; the first's result is the one written."""
    from transformer_jax.evaluation import scoring

    path, _ = workdir
    perplexity, calls, second = scoring.perplexity, [], []

    def perplexity_then_a_second_run(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:  # the first run's pass: the second run starts
            try:
                second.append(workdir_scoring.evaluate_workdir(
                    path, split="dev", average_last=1, beam_size=4, max_extra_len=4,
                    output_dir=str(tmp_path)))
            except UserError as e:
                second.append(e)
        return perplexity(*args, **kwargs)

    monkeypatch.setattr(scoring, "perplexity", perplexity_then_a_second_run)
    first = workdir_scoring.evaluate_workdir(path, split="dev", average_last=1, beam_size=1, max_extra_len=4,
                                             output_dir=str(tmp_path))
    [refusal] = second
    assert isinstance(refusal, UserError), refusal
    assert str(refusal).startswith(f"another evaluate.py (pid {os.getpid()} on ")
    assert f"is writing {tmp_path / 'dev-6'}.txt and .json now; wait for it to end" in str(refusal)
    with open(tmp_path / "dev-6.json") as f:
        assert json.load(f)["beam_size"] == 1 == first["beam_size"]
    assert sorted(os.listdir(tmp_path)) == ["dev-6.json", "dev-6.txt"]  # the claim is gone
    with pytest.raises(UserError, match="exists: this checkpoint was scored"):  # and the result is kept
        workdir_scoring.evaluate_workdir(path, split="dev", average_last=1, beam_size=4,
                                         output_dir=str(tmp_path))


def test_a_claim_left_by_a_killed_run_is_taken_over(workdir, tmp_path):
    path, _ = workdir
    dead = subprocess.Popen(["true"])
    dead.wait()
    import socket

    (tmp_path / ".dev-6.claim").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    workdir_scoring.evaluate_workdir(path, split="dev", average_last=1, output_dir=str(tmp_path), **{
        "beam_size": 1, "max_extra_len": 4})
    assert sorted(os.listdir(tmp_path)) == ["dev-6.json", "dev-6.txt"]


def test_a_damaged_step_asked_for_is_one_line(workdir, tmp_path):
    path = str(tmp_path / "run")
    shutil.copytree(workdir[0], path, ignore=shutil.ignore_patterns("eval"))
    integrity = os.path.join(path, "checkpoints", "4", "integrity", "metadata")
    with open(integrity) as f:
        record = json.load(f)
    key = "params/shared_embedding/embedding"
    record["arrays"][key]["h"] = f"{int(record['arrays'][key]['h'], 16) ^ 1:016x}"  # as if the array changed
    with open(integrity, "w") as f:
        json.dump(record, f)
    result = _evaluate(f"--workdir={path}", "--step=4", "--average_last=1", "--split=dev", *FAST)
    lines = [line for line in result.stderr.splitlines() if line.strip() and not ABSL_LOG_LINE.match(line)]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"error: checkpoint step 4 in {path}/checkpoints could not be restored "
                               "(CorruptCheckpointError: checksum mismatch in 1 array(s) (params/")
    assert lines[0].endswith("available steps: [2, 4, 6]. Choose another step, or leave the step out for the "
                             "newest one that restores")


@pytest.mark.slow
def test_an_ensemble_decodes_the_workdirs_models_together(workdir, tmp_path):
    path, _ = workdir
    same = str(tmp_path / "same")  # the same model: the ensemble must score exactly as it alone
    shutil.copytree(path, same, ignore=shutil.ignore_patterns("eval"))
    other = str(tmp_path / "other")  # another model of the same shape and tokenizer (untrained)
    untrained_workdir(config_with(TRAINED), other, steps=(6,))
    settings = {"split": "dev", "beam_size": 1, "max_extra_len": 4, "average_last": 1,
                "output_dir": str(tmp_path / "out")}
    single = workdir_scoring.evaluate_workdir(path, **settings)
    twice = workdir_scoring.evaluate_workdir(path, ensemble=(same,), **settings)
    assert re.fullmatch(r"dev-6-ens2-[0-9a-f]{8}\.json", os.path.basename(twice["outputs"][1]))
    assert twice["ensemble"] == [{"workdir": path, "averaged_steps": [6]},
                                 {"workdir": same, "averaged_steps": [6]}]
    assert twice["ppl"] == pytest.approx(single["ppl"], rel=1e-5)
    assert twice["sacrebleu"] == single["sacrebleu"]
    mixed = workdir_scoring.evaluate_workdir(path, ensemble=(other,), **settings)  # named apart: no refusal
    assert mixed["ppl"] != pytest.approx(single["ppl"], rel=1e-3)  # the untrained member counts
    assert mixed["outputs"][1] != twice["outputs"][1]
    with open(twice["outputs"][1]) as f:
        assert json.load(f)["ppl"] == twice["ppl"]  # the first ensemble's result is kept

    with pytest.raises(ConfigError, match="name each model once"):
        workdir_scoring.evaluate_workdir(path, ensemble=(same, same), **settings)
    with pytest.raises(MissingFileError, match=r"--ensemble=.*nowhere: no such directory"):
        workdir_scoring.evaluate_workdir(path, ensemble=(str(tmp_path / "nowhere"),), **settings)
    wider = str(tmp_path / "wider")
    untrained_workdir(config_with({**TRAINED, "model.d_ff": 26}), wider, steps=(6,))
    with pytest.raises(ConfigError, match=r"its model differs from --workdir's: d_ff=26 \(first: 22\)"):
        workdir_scoring.evaluate_workdir(path, ensemble=(wider,), **settings)
    # Training-time fields (Table 3 row D's dropout, the attention implementation, max_len under sinusoids)
    # do not shape the parameters: such a member joins.
    retrained = str(tmp_path / "retrained")
    untrained_workdir(config_with({**TRAINED, "model.dropout_rate": 0.3, "model.attention_impl": "blockwise",
                                   "model.max_len": 320}), retrained, steps=(6,))
    joined = workdir_scoring.evaluate_workdir(path, ensemble=(retrained,), **settings)
    assert joined["ensemble"][1] == {"workdir": retrained, "averaged_steps": [6]}
    retokenized = str(tmp_path / "retokenized")  # same shape, a vocabulary from other data
    untrained_workdir(config_with({**TRAINED, "data.synthetic_seed": 1}), retokenized, steps=(6,))
    with pytest.raises(ConfigError, match="its tokenizer differs from --workdir's"):
        workdir_scoring.evaluate_workdir(path, ensemble=(retokenized,), **settings)
    result = _evaluate(f"--workdir={path}", f"--ensemble={same},{other}", "--split=dev", "--average_last=1",
                       f"--output_dir={tmp_path / 'cli'}", *FAST)
    assert result.returncode == 0, result.stderr
    named = [n for n in os.listdir(tmp_path / "cli") if re.fullmatch(r"dev-6-ens3-[0-9a-f]{8}\.json", n)]
    assert len(named) == 1, os.listdir(tmp_path / "cli")


def test_by_length_scores_each_bucket_of_source_length(workdir, tmp_path):
    """--by_length: the buckets' sentences and sacreBLEU, recomputed from the outputs written; the table
    marks what lies beyond the training pairs' data.max_len; the plot lies beside the JSON."""
    from transformer_jax.checkpoints.restore import restore_workdir
    from transformer_jax.evaluation import bleu

    path, pairs = workdir
    out = tmp_path / "out"
    result = _evaluate(f"--workdir={path}", "--split=test", "--by_length", "--length_buckets=16,32,64",
                       f"--output_dir={out}", "--average_last=1", *FAST)
    assert result.returncode == 0, result.stderr
    with open(out / "test-6.json") as f:
        numbers = json.load(f)["by_length"]
    with open(out / "test-6.txt") as f:
        outputs = f.read().splitlines()
    assert (numbers["measure"], numbers["edges"], numbers["train_max_len"]) == ("sacreBLEU", [16, 32, 64], 64)
    tokenizer = restore_workdir(path).tokenizer
    lengths = [len(ids) + 1 for ids in tokenizer.encode_text([s for s, _ in pairs], side="source")]
    for row, (low, high) in zip(numbers["buckets"], [(1, 16), (17, 32), (33, 64), (65, None)], strict=True):
        members = [i for i, n in enumerate(lengths) if low <= n and (high is None or n <= high)]
        assert (row["bucket"], row["sentences"]) == (f"{low}-{high}" if high else f"{low}+", len(members))
        if members:
            assert row["score"] == pytest.approx(bleu.sacrebleu_score(
                [outputs[i] for i in members], [pairs[i][1] for i in members]).score)
            assert row["length_ratio"] == pytest.approx(sum(len(outputs[i].split()) for i in members)
                                                        / sum(len(pairs[i][1].split()) for i in members))
        assert row["training"] == ("beyond" if high is None else "within")
    assert sum(row["sentences"] for row in numbers["buckets"]) == len(pairs)
    with open(numbers["plot"], "rb") as f:
        assert numbers["plot"] == str(out / "test-6-by_length.png") and f.read(4) == b"\x89PNG"
    lines = result.stdout.strip().splitlines()
    assert lines[-3].startswith("training pairs had at most data.max_len=64 tokens a side")
    assert lines[-2].startswith("out/ref: the outputs' words over the references' words")
    last = numbers["buckets"][-1]
    assert lines[-4].split() == ["65+", str(last["sentences"]), f"{last['score']:.2f}",
                                 f"{last['length_ratio']:.2f}", "beyond"]
    assert lines[-1].startswith("scored the checkpoint at step 6")

    with pytest.raises(ConfigError, match=r"^--length_buckets sets the buckets of --by_length"):
        workdir_scoring.evaluate_workdir(path, length_buckets=[10, 20], output_dir=str(out))
    with pytest.raises(ConfigError, match=r"^--length_buckets=20,10: expected strictly increasing positive"):
        workdir_scoring.evaluate_workdir(path, by_length=True, length_buckets=["20", "10"],
                                         output_dir=str(out))


def test_ctrl_c_while_scoring_is_one_line_and_leaves_no_output(workdir, tmp_path):
    """SIGINT once evaluate.py claimed its outputs (restoring, scoring, decoding): one line, exit status
    130, and the output folder as it was (no result, no temporary file, no claim)."""
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "evaluate.py"), f"--workdir={workdir[0]}",
                             "--split=dev", "--average_last=1", f"--output_dir={tmp_path}", *FAST],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO)
    deadline = time.time() + 120
    while not (tmp_path / ".dev-6.claim").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, stderr
    assert [line for line in stderr.splitlines() if not ABSL_LOG_LINE.match(line)] == [
        "Stopped by SIGINT (Ctrl-C); no result was written (the outputs are written whole at the end). Run "
        "the same command again to score it."]
    assert os.listdir(tmp_path) == []


def test_ctrl_c_between_the_translations_and_the_scores_leaves_both(workdir, tmp_path, monkeypatch):
    """A Ctrl-C after the translations are written and before their scores waits for the scores: both
    files exist, and the next evaluate.py finds a whole result (it left a .txt alone before)."""
    path, _ = workdir
    written = []

    def write_then_interrupt(out_path, text):
        with open(out_path, "w") as f:
            f.write(text)
        written.append(out_path)
        if len(written) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(workdir_scoring, "_write", write_then_interrupt)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        workdir_scoring.evaluate_workdir(path, split="dev", beam_size=1, max_extra_len=4, average_last=1,
                                         output_dir=str(out))
    assert sorted(p for p in os.listdir(out) if not p.startswith(".")) == ["dev-6.json", "dev-6.txt"]
