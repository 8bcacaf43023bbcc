"""User errors at the entry points: two lines on stderr, exit 1, no traceback (issue 12, section 6).

Each command is a process of its own (``test_entry_points.Commands``) that fails during validation,
before JAX compiles anything.
"""

import subprocess
import sys

import pytest
from test_entry_points import Commands

from transformer_jax.runtime import errors


@pytest.fixture(scope="module")
def commands():
    with Commands() as server:
        yield server


def _assert_short(result: subprocess.CompletedProcess, *named: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert len(lines) <= 2, result.stderr
    assert lines[0].startswith("error: ")
    for text in named:
        assert text in lines[0]
    return lines[0]


def test_train_bad_config_field(tmp_path, commands):
    result = commands.run("train.py", f"--workdir={tmp_path / 'w'}", "--config.train.learning_rate_scale=-1")
    _assert_short(result, "config.train.learning_rate_scale=-1")
    assert not (tmp_path / "w").exists()  # nothing was created, let alone trained


def test_train_missing_data_file(tmp_path, commands):
    for name in ("train.en", "train.de", "val.en", "test.en", "test.de"):  # val.de is missing
        (tmp_path / name).write_text("a b\n")
    result = commands.run("train.py", f"--workdir={tmp_path / 'w'}", "--config.data.source=text",
                          f"--config.data.dir={tmp_path}")
    _assert_short(result, str(tmp_path / "val.de"), "dev split")
    assert not (tmp_path / "w").exists()


def test_a_data_error_found_at_start_leaves_no_workdir(tmp_path, commands):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("val.en", "val.de", "test.en", "test.de"):
        (data / name).write_text("a b\n")
    (data / "train.en").write_text("a b\nc d\n")
    (data / "train.de").write_text("a b\n")  # one line short
    result = commands.run("train.py", f"--workdir={tmp_path / 'w'}", "--config.data.source=text",
                          f"--config.data.dir={data}")
    _assert_short(result, "train.en has 2 lines", "train.de has 1 lines")
    assert not (tmp_path / "w").exists()


def test_an_eval_line_the_model_cannot_take_stops_the_run_at_start(tmp_path, commands):
    data = tmp_path / "data"
    data.mkdir()
    words = [f"w{i}" for i in range(30)]
    lines = [" ".join(words[(i + k) % 30] for k in range(2 + i % 5)) for i in range(200)]
    for split in ("train", "val", "test"):
        src = lines[:200] if split == "train" else lines[:9]
        if split == "val":
            src = src[:2] + [" ".join(words * 10)] + src[3:]  # 300 words: more than model.max_len=256
        (data / f"{split}.en").write_text("".join(line + "\n" for line in src))
        (data / f"{split}.de").write_text("".join(line.upper() + "\n" for line in src))
    workdir = tmp_path / "w"
    result = commands.run("train.py", f"--workdir={workdir}", "--config.data.source=text",
                          f"--config.data.dir={data}", "--config.data.vocab_size=36",
                          "--config.peak_tflops_per_device=1",
                          "--config.model.position_encoding=learned")  # the one scheme with a bound
    _assert_short(result, f"{data / 'val.en'}:3: the source has", "more than the model's max_len=256")
    assert "Model:" not in result.stdout  # before the model was built
    assert not (workdir / "checkpoints").exists()


def test_data_dir_naming_a_file_says_so(tmp_path, commands):
    (tmp_path / "train.en").write_text("a b\n")
    result = commands.run("train.py", f"--workdir={tmp_path / 'w'}", "--config.data.source=text",
                          f"--config.data.dir={tmp_path / 'train.en'}")
    assert _assert_short(result) == (f"error: data.dir={tmp_path / 'train.en'} is a file; expected the "
                                     "folder that holds the data files. Point data.dir at its folder")


def test_a_nan_is_not_a_finite_number(tmp_path, commands):
    result = commands.run("train.py", f"--workdir={tmp_path / 'w'}", "--config.train.learning_rate_scale=nan")
    line = _assert_short(result, "config.train.learning_rate_scale=nan")
    assert "a finite number > 0" in line and "inf]" not in line


def test_evaluate_missing_workdir_and_bad_flag(tmp_path, commands):
    _assert_short(commands.run("evaluate.py", f"--workdir={tmp_path / 'nope'}"), "nope: no such directory")
    _assert_short(commands.run("evaluate.py", f"--workdir={tmp_path}", "--average_last=-1"),
                  "--average_last=-1")


def test_the_environment_variable_shows_the_traceback(tmp_path, commands):
    result = commands.run("evaluate.py", f"--workdir={tmp_path / 'nope'}", traceback=True)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "MissingFileError" in result.stderr


def test_a_real_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)

    def buggy(argv):
        raise KeyError("a bug, not a user error")

    with pytest.raises(KeyError):
        errors.short_errors(buggy)([])


def test_user_error_becomes_two_lines_and_exit_1(monkeypatch, capsys):
    monkeypatch.delenv(errors.TRACEBACK_ENV, raising=False)

    def main(argv):
        raise errors.ConfigError("config.x=3: expected an integer >= 4")

    with pytest.raises(SystemExit) as info:
        errors.short_errors(main)([])
    assert info.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: config.x=3: expected an integer >= 4", f"(set {errors.TRACEBACK_ENV}=1 for the traceback)"]
    monkeypatch.setenv(errors.TRACEBACK_ENV, "1")
    with pytest.raises(errors.ConfigError):
        errors.short_errors(main)([])


def test_asking_for_a_gpu_on_this_cpu_stops_train_before_any_work(tmp_path, commands):
    result = commands.run("train.py", f"--workdir={tmp_path / 'w'}", "--config.platform=gpu")
    line = _assert_short(result, "config.platform='gpu'", 'pip install -c constraints.txt -e ".[cuda12]"')
    assert "only cpu devices" in line or "did not load" in line
    assert not (tmp_path / "w").exists()


def test_a_wmt_config_on_this_cpu_stops_at_the_device_before_reading_data(tmp_path, commands):
    result = commands.run("train.py", "--config=configs/wmt14_en_de_base.py", f"--workdir={tmp_path / 'w'}",
                          f"--config.data.tfds_data_dir={tmp_path / 'no_data'}")
    _assert_short(result, "config.platform='accelerator'", '".[cuda12]"', '".[tpu]"')
    assert not (tmp_path / "w").exists()


def test_train_says_which_kernel_fused_attention_takes_here(tmp_path, commands):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "val", "test"):
        for lang in ("en", "de"):
            (data / f"{split}.{lang}").write_text("a b\nc d\n")
    result = commands.run("train.py", f"--workdir={tmp_path / 'w'}", "--config.data.source=text",
                          f"--config.data.dir={data}", "--config.model.attention_impl=fused")
    _assert_short(result, "vocab_size=1000 is too large")  # stops at the tokenizer, after the line below
    assert "fused attention: XLA, not cuDNN (the backend is cpu, cuDNN needs an NVIDIA GPU)" in result.stdout


# Ctrl-C that lands in a garbage collector's callback (jax has one), where Python prints and drops it.
INTERRUPTED_IN_A_GC_CALLBACK = """
import gc, os, signal, time
from transformer_jax.runtime import errors

def main(argv):
    def interrupt_here(phase, info):
        if phase == "start" and not sent:
            sent.append(phase)
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(10))  # ordinary code again: the KeyboardInterrupt is raised here, in the callback
    sent = []
    gc.callbacks.append(interrupt_here)
    gc.collect()
    gc.callbacks.remove(interrupt_here)
    time.sleep(10)  # the command's work
    print("ran to the end")

errors.run_main(main)
"""


def test_ctrl_c_that_lands_in_a_garbage_collector_callback_still_stops_the_command():
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_IN_A_GC_CALLBACK], capture_output=True,
                            text=True, timeout=120)
    assert (result.returncode, result.stdout) == (errors.INTERRUPTED_EXIT_STATUS, ""), result
    assert result.stderr.splitlines() == ["Stopped by SIGINT (Ctrl-C)."]
