"""Tests for configs/table3.py and transformer_jax.sweep (grid, launchers, command line).

Nothing here trains: the local launcher's subprocess runner is replaced by a fake that writes what
train.py and evaluate.py would (the final ``metrics.jsonl`` record and ``eval/dev-<step>.json``).
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from absl import flags
from test_output_file import unwritable_folders

from configs import table3, wmt14_en_de_base
from transformer_jax.evaluation import paper
from transformer_jax.model.config import ModelConfig, param_count
from transformer_jax.run_config import build_run_config
from transformer_jax.sweep import __main__ as cli
from transformer_jax.sweep import grid, launchers
from transformer_jax.sweep import report as sweep_report

CPU_STEPS = 300  # 100k paper steps x 3/1000


def run(*args: str) -> int:
    """``python -m transformer_jax.sweep *args``, in-process, on fresh flags."""
    flag_values = flags.FlagValues()
    cli.define_flags(flag_values)
    return cli.main(flag_values(["sweep", *args]), flag_values)


# ---------------------------------------------------------------------------------------------------
# configs/table3.py


def _model(config) -> ModelConfig:
    return ModelConfig(vocab_size=config.data.vocab_size, **config.model)


@pytest.mark.parametrize("scale", table3.SCALES)
def test_every_row_builds_a_valid_config(scale):
    for row in paper.TABLE3:
        config = table3.get_config(f"{row.name},{scale}")
        build_run_config(config, environment=False)  # the config alone: data files may be elsewhere
        _model(config)
        assert config.name == f"table3/{row.name}"
        assert config.data.source == {"paper": "tfds", "cpu": "synthetic", "multi30k": "text"}[scale]


# (d_model, d_ff, h, d_k, d_v, N, P_drop, positions, eps_ls, steps), written out from Table 3 and the
# cpu mapping in configs/table3.py (widths / 8, N / 2, steps x 3/1000).
EXPECTED = {
    ("base", "paper"): (512, 2048, 8, 64, 64, 6, 0.1, "sinusoidal", 0.1, 100_000),
    ("A-heads1", "paper"): (512, 2048, 1, 512, 512, 6, 0.1, "sinusoidal", 0.1, 100_000),
    ("B-dk16", "paper"): (512, 2048, 8, 16, 64, 6, 0.1, "sinusoidal", 0.1, 100_000),
    ("C-layers2", "paper"): (512, 2048, 8, 64, 64, 2, 0.1, "sinusoidal", 0.1, 100_000),
    ("D-ls0.2", "paper"): (512, 2048, 8, 64, 64, 6, 0.1, "sinusoidal", 0.2, 100_000),
    ("big", "paper"): (1024, 4096, 16, 64, 64, 6, 0.3, "sinusoidal", 0.1, 300_000),
    ("base", "cpu"): (64, 256, 8, 8, 8, 3, 0.1, "sinusoidal", 0.1, 300),
    ("A-heads32", "cpu"): (64, 256, 32, 2, 2, 3, 0.1, "sinusoidal", 0.1, 300),
    ("B-dk16", "cpu"): (64, 256, 8, 2, 8, 3, 0.1, "sinusoidal", 0.1, 300),
    ("C-layers8", "cpu"): (64, 256, 8, 8, 8, 4, 0.1, "sinusoidal", 0.1, 300),
    ("C-dmodel256", "cpu"): (32, 256, 8, 4, 4, 3, 0.1, "sinusoidal", 0.1, 300),
    ("C-dff4096", "cpu"): (64, 512, 8, 8, 8, 3, 0.1, "sinusoidal", 0.1, 300),
    ("D-drop0.0", "cpu"): (64, 256, 8, 8, 8, 3, 0.0, "sinusoidal", 0.1, 300),
    ("D-ls0.0", "cpu"): (64, 256, 8, 8, 8, 3, 0.1, "sinusoidal", 0.0, 300),
    ("E-learned-pos", "cpu"): (64, 256, 8, 8, 8, 3, 0.1, "learned", 0.1, 300),
    ("big", "cpu"): (128, 512, 16, 8, 8, 3, 0.3, "sinusoidal", 0.1, 900),
    # multi30k: widths / 4, N x 2/3, steps x 3/500.
    ("base", "multi30k"): (128, 512, 8, 16, 16, 4, 0.1, "sinusoidal", 0.1, 600),
    ("A-heads1", "multi30k"): (128, 512, 1, 128, 128, 4, 0.1, "sinusoidal", 0.1, 600),
    ("A-heads32", "multi30k"): (128, 512, 32, 4, 4, 4, 0.1, "sinusoidal", 0.1, 600),
    ("B-dk32", "multi30k"): (128, 512, 8, 8, 16, 4, 0.1, "sinusoidal", 0.1, 600),
    ("C-layers2", "multi30k"): (128, 512, 8, 16, 16, 1, 0.1, "sinusoidal", 0.1, 600),
    ("C-layers8", "multi30k"): (128, 512, 8, 16, 16, 5, 0.1, "sinusoidal", 0.1, 600),
    ("D-drop0.2", "multi30k"): (128, 512, 8, 16, 16, 4, 0.2, "sinusoidal", 0.1, 600),
    ("D-ls0.2", "multi30k"): (128, 512, 8, 16, 16, 4, 0.1, "sinusoidal", 0.2, 600),
    ("E-learned-pos", "multi30k"): (128, 512, 8, 16, 16, 4, 0.1, "learned", 0.1, 600),
    ("big", "multi30k"): (256, 1024, 16, 16, 16, 4, 0.3, "sinusoidal", 0.1, 1800),
}


@pytest.mark.parametrize("row, scale", EXPECTED)
def test_rows_by_hand(row, scale):
    config = table3.get_config(f"{row},{scale}")
    m = _model(config)
    assert m.num_encoder_layers == m.num_decoder_layers
    assert (m.d_model, m.d_ff, m.num_heads, m.d_k, m.d_v, m.num_encoder_layers, m.dropout_rate,
            m.position_encoding, config.train.label_smoothing, config.train.num_steps) == EXPECTED[row, scale]


BEYOND = {"E+-rotary-pos": "rotary", "E+-alibi-pos": "alibi", "E+-relative-pos": "relative",
          "E+-no-pos": "none"}


@pytest.mark.parametrize("scale", ["cpu", "multi30k"])
def test_rows_beyond_the_paper_build_valid_configs(scale):
    """E+ rows are row E with another position scheme: everything else is the base row at that scale."""
    assert {r.name: r.model["position_encoding"] for r in paper.TABLE3_BEYOND} == BEYOND
    base = table3.get_config(f"base,{scale}").to_dict()
    base.pop("name")
    for name, scheme in BEYOND.items():
        config = table3.get_config(f"{name},{scale}")
        run = build_run_config(config, environment=False)
        assert run.model.position_encoding == scheme and config.name == f"table3/{name}"
        ours = config.to_dict()
        ours.pop("name")
        ours["model"]["position_encoding"] = "sinusoidal"
        assert ours == base
        assert name not in paper.TABLE3_BY_NAME  # never matched with a paper row
    rows = grid.table3_rows("E+", scale)
    params = {r.name: param_count(build_run_config(grid.build_config(r), environment=False).model)
              for r in rows}  # validate_rows would also want the data files
    assert [r.name for r in rows] == list(BEYOND)
    assert all(r.beyond_paper and r.paper_row is None and r.table3_row == r.name for r in rows)
    assert [r.changes for r in rows] == [(("position_encoding", s),) for s in BEYOND.values()]
    # Relative positions add a table of 2k+1 rows (k = 16) for keys and values to every self-attention.
    d_k = {"cpu": 8, "multi30k": 16}[scale]
    layers = {"cpu": 3, "multi30k": 4}[scale] * 2
    assert params["E+-relative-pos"] - params["E+-rotary-pos"] == layers * 33 * 2 * d_k
    assert params["E+-alibi-pos"] == params["E+-no-pos"] == params["E+-rotary-pos"]


def test_cpu_layers_stay_distinct_and_in_order():
    layers = [table3.get_config(f"C-layers{n},cpu").model.num_encoder_layers for n in (2, 4, 8)]
    assert layers == [1, 2, 4]


def test_paper_base_row_is_the_base_config_unchanged():
    ours = table3.get_config("base").to_dict()
    theirs = wmt14_en_de_base.get_config().to_dict()
    assert ours.pop("name") == "table3/base"
    theirs.pop("name")
    assert ours == theirs


def test_config_argument_errors_list_the_choices():
    with pytest.raises(ValueError, match="valid rows: base, A-heads1"):
        table3.get_config("C-dmodel257")
    with pytest.raises(ValueError, match="valid scales: paper, cpu"):
        table3.get_config("base,gpu")
    with pytest.raises(ValueError, match="<row>"):
        table3.get_config("base,cpu,extra")
    assert table3.get_config(None).name == "table3/base"


def test_a_row_naming_a_missing_field_fails(monkeypatch):
    bad = paper.Table3Row("base", "base", {"num_layers": 3}, {}, 4.92, 25.8, 65)  # the old name of N
    monkeypatch.setitem(paper.TABLE3_ALL_BY_NAME, "base", bad)
    with pytest.raises(KeyError, match="num_layers"):
        table3.get_config("base,paper")


# ---------------------------------------------------------------------------------------------------
# Row selection and generic grids.


def _names(rows):
    return [r.name for r in rows]


def test_select_rows_by_group_and_name():
    assert _names(grid.select_table3_rows("A")) == ["A-heads1", "A-heads4", "A-heads16", "A-heads32"]
    assert _names(grid.select_table3_rows("E,base,D-ls0.2")) == ["base", "D-ls0.2", "E-learned-pos"]
    assert _names(grid.select_table3_rows("big")) == ["big"]
    assert len(grid.select_table3_rows(None)) == 20
    with pytest.raises(ValueError, match=r"'F'.*groups: base, A, B, C, D, E, E\+, big.*rows: base, A-heads1"):
        grid.select_table3_rows("A,F")


def test_table3_rows_carry_scaled_changes():
    rows = {r.name: r for r in grid.table3_rows("C-dmodel256,big", "cpu")}
    assert dict(rows["C-dmodel256"].changes) == {"d_model": 32, "d_k": 4, "d_v": 4}
    assert dict(rows["big"].changes) == {"d_model": 128, "d_ff": 512, "num_heads": 16, "dropout_rate": 0.3,
                                         "num_steps": 900}
    assert rows["C-dmodel256"].config_arg == "configs/table3.py:C-dmodel256,cpu"
    assert rows["big"].config_arg == "configs/table3.py:big,cpu"


def test_grid_is_a_typed_cartesian_product():
    rows = grid.parse_grid("model.num_heads=1,4,8 model.dropout_rate=0.0,0.1", "configs/default.py")
    assert len(rows) == 6
    assert rows[3].name == "model.num_heads=4,model.dropout_rate=0.1"
    assert rows[3].overrides == (("model.num_heads", 4), ("model.dropout_rate", 0.1))
    assert all(isinstance(dict(r.overrides)["model.num_heads"], int) for r in rows)
    assert all(isinstance(dict(r.overrides)["model.dropout_rate"], float) for r in rows)
    rows = grid.parse_grid(
        "data.length_buckets=(32,64),(64,) model.attention_witness=true model.position_encoding=learned",
        "configs/default.py")
    assert [dict(r.overrides)["data.length_buckets"] for r in rows] == [(32, 64), (64,)]
    assert dict(rows[0].overrides)["model.attention_witness"] is True
    assert rows[1].name == ("data.length_buckets=(64,),model.attention_witness=true,"
                            "model.position_encoding=learned")
    config = grid.build_config(rows[1])
    assert config.data.length_buckets == (64,) and config.model.position_encoding == "learned"


@pytest.mark.parametrize("spec, message", [
    ("model.num_head=1,2", r"bad grid value model.num_head='1'.*num_heads"),  # did you mean
    ("modle.num_heads=1", r"bad grid value modle.num_heads='1'"),
    ("model=1", r"bad grid value model='1'"),
    ("model.num_heads=4,four", r"bad grid value model.num_heads='four'.*int"),
    ("model.num_heads=1.5", r"model.num_heads='1.5'.*int"),
    ("model.dropout_rate=high", r"model.dropout_rate='high'.*float"),
    ("model.num_heads", r"expected key=value1,value2"),
    ("model.num_heads=1 model.num_heads=2", r"appears twice"),
    ("model.num_heads=1,", r"empty value"),
])
def test_bad_grid_specs_fail(spec, message):
    with pytest.raises(ValueError, match=message):
        grid.parse_grid(spec, "configs/default.py")


def test_invalid_model_fails_before_anything_trains(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(launchers, "run_command", lambda command, log: calls.append(command) or 0)
    rows = grid.parse_grid("model.num_heads=4,3", "configs/default.py")  # d_model=128: 3 does not divide
    with pytest.raises(ValueError, match=r"row 'model.num_heads=3'.*not divisible by num_heads=3"):
        grid.validate_rows(rows)
    code = run("--grid", "model.num_heads=4,3", "--workdir", str(tmp_path / "s"))
    assert code == 1 and calls == []
    assert "not divisible" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # nothing was written either
    assert run("--grid", "model.num_heads=x", "--workdir", str(tmp_path / "s")) == 1
    assert run("--grid", "table3", "--rows", "A-heads3", "--workdir", str(tmp_path / "s")) == 1
    assert calls == []


# ---------------------------------------------------------------------------------------------------
# The local launcher: skipping and resuming, with a fake train.py / evaluate.py.


class FakeRunner:
    """Stands in for ``launchers.run_command``: records commands, writes what the real scripts write."""

    def __init__(self, preempt_once=(), fail=()):
        self.commands, self.preempt_once, self.fail = [], set(preempt_once), set(fail)

    def __call__(self, command, log_path):
        row_dir = next(a.split("=", 1)[1] for a in command if a.startswith("--workdir="))
        os.makedirs(row_dir, exist_ok=True)  # as train.py does
        row = os.path.basename(row_dir)
        script = command[1]
        self.commands.append((script, row))
        if row in self.fail:
            return 1
        num_steps = table3.get_config(f"{row.partition('-seed')[0]},cpu").train.num_steps  # base-seed1: base
        if script == "train.py":
            with open(os.path.join(row_dir, "metrics.jsonl"), "a") as f:
                if row in self.preempt_once:  # stopped half-way: no final record
                    self.preempt_once.discard(row)
                    f.write(json.dumps({"step": num_steps // 2, "train_loss": 4.0}) + "\n")
                else:
                    f.write(json.dumps({"step": num_steps, "train_seconds": 12.5, "dev_ppl": 9.0}) + "\n")
        else:
            os.makedirs(os.path.join(row_dir, "eval"), exist_ok=True)
            ppl = 10.0 + len(row) / 10
            with open(os.path.join(row_dir, "eval", f"dev-{num_steps}.json"), "w") as f:
                json.dump({"step": num_steps, "ppl": ppl, "tokenized_bleu": 20.0, "sacrebleu": 19.0,
                           "beam_size": 1, "num_sentences": 200}, f)
        return 0


def test_local_sweep_skips_finished_rows_and_resumes_partial_ones(tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "t3"
    runner = FakeRunner(preempt_once={"A-heads4"})
    monkeypatch.setattr(launchers, "run_command", runner)
    args = ["--grid", "table3", "--rows", "A-heads1,A-heads4,E", "--scale", "cpu", "--base_seeds", "1",
            "--workdir", str(workdir)]
    # A half-finished sweep: base done, A-heads1 trained but not evaluated.
    (workdir / "base").mkdir(parents=True)
    (workdir / "base" / "result.json").write_text(json.dumps(
        {"row": "base", "step": CPU_STEPS, "dev_ppl": 9.0, "dev_bleu": 20.0}))
    (workdir / "A-heads1").mkdir()
    (workdir / "A-heads1" / "metrics.jsonl").write_text(
        json.dumps({"step": CPU_STEPS, "train_seconds": 30.0}) + "\n")

    assert run(*args) == 1  # A-heads4 was preempted: not finished yet
    assert runner.commands == [("evaluate.py", "A-heads1"), ("train.py", "A-heads4"),
                               ("train.py", "E-learned-pos"), ("evaluate.py", "E-learned-pos")]
    assert not (workdir / "A-heads4" / "result.json").exists()
    result = json.loads((workdir / "E-learned-pos" / "result.json").read_text())
    assert result["step"] == CPU_STEPS and result["dev_bleu"] == 20.0 and result["beam_size"] == 1
    assert result["changes"] == {"position_encoding": "learned"}

    runner.commands.clear()
    assert run(*args) == 0  # resumes A-heads4 only
    assert runner.commands == [("train.py", "A-heads4"), ("evaluate.py", "A-heads4")]
    attempts = json.loads((workdir / "A-heads4" / "result.json").read_text())["attempts"]
    assert attempts == 2

    runner.commands.clear()
    assert run(*args) == 0
    assert runner.commands == []  # everything finished: all skipped
    manifest = json.loads((workdir / "sweep.json").read_text())
    assert [r["name"] for r in manifest["rows"]] == ["base", "A-heads1", "A-heads4", "E-learned-pos"]


def test_an_attempt_killed_with_the_launcher_counts_until_its_log_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(launchers, "run_command", FakeRunner())
    row_dir = tmp_path / "A-heads4"
    row_dir.mkdir()
    # The first attempt started 100 s ago; launcher and train.py were killed 40 s ago (the log's last write).
    started = 1_000_000.0
    (row_dir / launchers.ATTEMPTS).write_text(json.dumps({"phase": "train", "started": started}) + "\n")
    (row_dir / "train.log").write_text("...")
    os.utime(row_dir / "train.log", (started + 60, started + 60))
    assert launchers.attempt_seconds(str(row_dir)) == (60.0, 1)
    assert run("--rows", "A-heads4", "--base_seeds", "1", "--scale", "cpu", "--workdir", str(tmp_path)) == 0
    result = json.loads((row_dir / "result.json").read_text())
    assert result["attempts"] == 2
    # The killed attempt's 60 s plus the second attempt's train and evaluate phases (fake: ~0 s).
    assert 60.0 <= result["wall_seconds"] < 65.0


def test_a_killed_attempt_counts_until_the_next_one_started(tmp_path):
    """The next attempt writes the same log: its writes must not count for the killed one."""
    row_dir = tmp_path / "base"
    row_dir.mkdir()
    started = 1_000_000.0
    records = [{"phase": "train", "started": started},  # killed 30 s in, with its launcher
               {"phase": "train", "started": started + 30},
               {"phase": "train", "started": started + 30, "seconds": 200.0, "returncode": 0}]
    (row_dir / launchers.ATTEMPTS).write_text("".join(json.dumps(r) + "\n" for r in records))
    (row_dir / "train.log").write_text("...")
    os.utime(row_dir / "train.log", (started + 230, started + 230))  # the second attempt's last write
    assert launchers.attempt_seconds(str(row_dir)) == (230.0, 2)


def test_a_crashing_row_does_not_stop_the_sweep(tmp_path, monkeypatch):
    runner = FakeRunner(fail={"D-ls0.0"})
    monkeypatch.setattr(launchers, "run_command", runner)
    assert run("--rows", "D-ls0.0,D-ls0.2", "--scale", "cpu", "--workdir", str(tmp_path)) == 1
    assert ("train.py", "D-ls0.2") in runner.commands
    assert (tmp_path / "D-ls0.2" / "result.json").exists()
    assert not (tmp_path / "D-ls0.0" / "result.json").exists()


def test_a_workdir_holds_one_sweep(tmp_path, monkeypatch):
    monkeypatch.setattr(launchers, "run_command", FakeRunner())
    assert run("--rows", "base", "--scale", "cpu", "--workdir", str(tmp_path)) == 0
    assert run("--rows", "base", "--scale", "paper", "--workdir", str(tmp_path),
               "--launcher", "print") == 1


# A stand-in for a row's train.py: notes the signal it gets, then exits 0 (as train.py does after saving).
_ROW = """
import signal, sys, time
log = open(sys.argv[1], "a")
stop = lambda s, f: (log.write(f"saved and stopped by {signal.Signals(s).name}\\n"), log.flush(), sys.exit(0))
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
log.write("started\\n"); log.flush()
time.sleep(60)
"""
# A launcher running that row through ``run_command`` (its log is the row's "train.log").
_LAUNCHER = """
import sys
from transformer_jax.sweep import launchers
code = launchers.run_command([sys.executable, "-c", sys.argv[1], sys.argv[2]], sys.argv[3])
print("exit", code, flush=True)
"""


def _launch_row(tmp_path):
    marks, log = tmp_path / "marks", tmp_path / "row" / "train.log"
    log.parent.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _ROW, str(marks), str(log)],
                                cwd=launchers.REPO_ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (marks.exists() and "started" in marks.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    return launcher, marks


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_launcher_passes_a_signal_to_its_row_and_waits_for_it(tmp_path, signum):
    launcher, marks = _launch_row(tmp_path)
    launcher.send_signal(signum)
    out, _ = launcher.communicate(timeout=60)
    assert marks.read_text() == f"started\nsaved and stopped by {signum.name}\n" and "exit 0" in out


def test_a_row_stops_when_its_launcher_is_killed(tmp_path):
    launcher, marks = _launch_row(tmp_path)
    launcher.kill()  # kill -9: no handler runs; the row gets SIGTERM from the kernel (PR_SET_PDEATHSIG)
    launcher.wait(timeout=60)
    deadline = time.time() + 30
    while "saved and stopped" not in marks.read_text() and time.time() < deadline:
        time.sleep(0.05)
    assert marks.read_text() == "started\nsaved and stopped by SIGTERM\n"


def test_print_and_slurm_launchers(tmp_path, capsys):
    assert run("--rows", "C-dmodel256", "--scale", "cpu", "--workdir", str(tmp_path),
               "--launcher", "print") == 0
    out = capsys.readouterr().out
    assert out.count("train.py --config=configs/table3.py:") == 4  # base is added, with 3 seeds
    assert out.count("train.py --config=configs/table3.py:base,cpu --config.seed=2 ") == 1
    assert "--config=configs/table3.py:C-dmodel256,cpu" in out and "evaluate.py" in out
    assert "--split=dev --beam_size=1 --average_last=1" in out and "(paper x10^6: 28)" in out


def test_overrides_reach_every_row_typed(tmp_path, capsys):
    assert run("--rows", "E", "--scale", "cpu", "--base_seeds", "2", "--override",
               "data.synthetic_dev_size=50", "--override", "train.warmup_steps=7", "--workdir", str(tmp_path),
               "--launcher", "print") == 0
    train_lines = [line for line in capsys.readouterr().out.splitlines() if "train.py" in line]
    assert len(train_lines) == 3  # base, base-seed1, E-learned-pos
    assert all("--config.data.synthetic_dev_size=50 --config.train.warmup_steps=7" in line
               for line in train_lines)
    base, learned = grid.table3_rows("base,E", "cpu", overrides=["train.warmup_steps=7"])
    assert base.overrides == learned.overrides == (("train.warmup_steps", 7),)  # an int, as the field
    assert learned.changes == (("position_encoding", "learned"),)  # overrides are not changes
    assert run("--rows", "E", "--scale", "cpu", "--override", "warmup", "--workdir", str(tmp_path / "x")) == 1
    assert run("--rows", "E", "--scale", "cpu", "--override", "train.warmup_steps=x",
               "--workdir", str(tmp_path / "x")) == 1
    assert run("--grid", "model.num_heads=2,4", "--override", "seed=1", "--workdir", str(tmp_path / "x")) == 1
    assert "key=value" in capsys.readouterr().err
    # Data elsewhere than the config says: every row's files are checked before anything runs.
    assert run("--rows", "E", "--scale", "multi30k", "--override", f"data.dir={tmp_path / 'none'}",
               "--workdir", str(tmp_path / "m"), "--launcher", "print") == 1
    assert str(tmp_path / "none") in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_base_seeds_are_extra_rows_in_every_launcher(tmp_path, monkeypatch):
    runner = FakeRunner()
    monkeypatch.setattr(launchers, "run_command", runner)
    assert run("--rows", "E", "--scale", "cpu", "--workdir", str(tmp_path / "local")) == 0
    assert [row for script, row in runner.commands if script == "train.py"] == [
        "base", "base-seed1", "base-seed2", "E-learned-pos"]
    manifest = json.loads((tmp_path / "local" / "sweep.json").read_text())
    assert [(r["name"], r["paper_row"], r["changes"]) for r in manifest["rows"]] == [
        ("base", "base", {}), ("base-seed1", "base", {"seed": 1}), ("base-seed2", "base", {"seed": 2}),
        ("E-learned-pos", "E-learned-pos", {"position_encoding": "learned"})]
    result = json.loads((tmp_path / "local" / "base-seed2" / "result.json").read_text())
    assert result["changes"] == {"seed": 2}

    assert run("--rows", "E", "--scale", "cpu", "--workdir", str(tmp_path / "slurm"),
               "--launcher", "slurm") == 0
    script = (tmp_path / "slurm" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-3" in script and "#   1: base-seed1" in script
    assert "--rows=base,E-learned-pos --base_seeds=3" in script  # task i rebuilds the same 4 rows
    assert run("--rows", "E", "--base_seeds", "0", "--scale", "cpu", "--workdir", str(tmp_path / "x")) == 1


def test_rows_beyond_the_paper_are_chosen_by_name_and_run_with_their_seeds(tmp_path, monkeypatch, capsys):
    assert _names(grid.select_table3_rows("E+,E")) == ["E-learned-pos", *BEYOND]  # after E
    assert _names(grid.select_table3_rows("big,E+-no-pos")) == ["E+-no-pos", "big"]
    assert not any(r.group == "E+" for r in grid.select_table3_rows(None))  # the paper's rows by default
    runner = FakeRunner()
    monkeypatch.setattr(launchers, "run_command", runner)
    args = ["--rows", "E,E+-alibi-pos", "--seeds", "2", "--base_seeds", "2", "--scale", "cpu"]
    assert run(*args, "--workdir", str(tmp_path / "local")) == 0
    names = ["base", "base-seed1", "E-learned-pos", "E-learned-pos-seed1", "E+-alibi-pos",
             "E+-alibi-pos-seed1"]
    assert [row for script, row in runner.commands if script == "train.py"] == names
    manifest = json.loads((tmp_path / "local" / "sweep.json").read_text())
    assert [(r["name"], r["paper_row"], r["table3_row"], r["beyond_paper"]) for r in manifest["rows"]] == [
        ("base", "base", "base", False), ("base-seed1", "base", "base", False),
        ("E-learned-pos", "E-learned-pos", "E-learned-pos", False),
        ("E-learned-pos-seed1", "E-learned-pos", "E-learned-pos", False),
        ("E+-alibi-pos", None, "E+-alibi-pos", True), ("E+-alibi-pos-seed1", None, "E+-alibi-pos", True)]
    assert manifest["rows"][-1]["changes"] == {"position_encoding": "alibi", "seed": 1}
    # The slurm array rebuilds the same rows in every task: task 5 is E+-alibi-pos-seed1.
    assert run(*args, "--workdir", str(tmp_path / "slurm"), "--launcher", "slurm") == 0
    script = (tmp_path / "slurm" / "sweep.sbatch").read_text()
    assert "--rows=base,E-learned-pos,E+-alibi-pos --base_seeds=2 --seeds=2" in script
    runner.commands.clear()
    assert run(*_array_task_argv(script, 5)) == 0
    assert runner.commands == [("train.py", "E+-alibi-pos-seed1"), ("evaluate.py", "E+-alibi-pos-seed1")]
    assert run("--rows", "E", "--seeds", "0", "--scale", "cpu", "--workdir", str(tmp_path / "x")) == 1
    assert run("params", "--rows", "E+-no-pos", "--scale", "cpu") == 0
    line = "| E+-no-pos | position_encoding=none (beyond the paper) | 411,904 | 0.4 | — |"
    assert line in capsys.readouterr().out
    assert run("--grid", "model.num_heads=2,4", "--seeds", "2", "--workdir", str(tmp_path / "x")) == 1


@pytest.mark.parametrize("scale, rows, item, message", [
    ("cpu", "E", "model.position_encoding=rotary",
     "changes a field row E-learned-pos sets (position_encoding)"),
    ("cpu", "base,big", "train.num_steps=50", "changes a field row big sets (num_steps)"),
    ("multi30k", "D", "model.dropout_rate=0.3", "changes a field row D-drop0.0 sets (dropout_rate)"),
    ("paper", "E", "model.position_encoding=rotary", "changes a field the paper fixes for every Table 3 row"),
    ("paper", "D", "train.warmup_steps=100", "changes a field the paper fixes"),  # the paper's recipe
    ("paper", "base", "model.d_model=16", "changes a field the paper fixes"),  # a column no chosen row sets
])
def test_an_override_that_makes_a_row_another_row_is_refused_in_one_line(tmp_path, monkeypatch, capsys,
                                                                         scale, rows, item, message):
    runner = FakeRunner()
    monkeypatch.setattr(launchers, "run_command", runner)
    assert run("--rows", rows, "--scale", scale, "--override", item, "--workdir", str(tmp_path / "s")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith(f"error: --override={item} {message}"), err
    assert f"--grid '{item}' --config configs/table3.py:base,{scale}" in err[0]
    assert runner.commands == [] and not (tmp_path / "s").exists()


def test_an_override_of_a_field_no_chosen_row_sets_shrinks_every_row(tmp_path, capsys):
    """Below paper scale an override sets the base of every row: a smaller model for rows D and E."""
    assert run("--rows", "D,E", "--scale", "cpu", "--override", "model.d_model=16", "--override",
               "train.num_steps=50", "--workdir", str(tmp_path), "--launcher", "print") == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python train.py")]
    assert len(commands) == 8  # base and its 2 seed rows, the 4 rows of D, the 1 of E
    assert all("--config.model.d_model=16" in c and "--config.train.num_steps=50" in c for c in commands)


def test_a_seed_override_runs_every_row_with_it_and_is_refused_beside_seed_rows(tmp_path, capsys):
    # The base row that is added runs with the one seed too: --base_seeds defaults to 1 beside seed=N.
    assert run("--rows", "E+", "--scale", "cpu", "--override", "seed=5", "--workdir", str(tmp_path / "s"),
               "--launcher", "print") == 0
    trains = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python train.py")]
    assert len(trains) == 5 and all("--config.seed=5" in line for line in trains)  # base and 4 E+ rows
    assert run("params", "--rows", "E+", "--scale", "cpu", "--base_seeds", "3", "--override", "seed=5") == 0
    for extra, row in ((("--base_seeds", "2"), "base-seed1"), (("--seeds", "2"), "E-learned-pos-seed1")):
        assert run("--rows", "E", "--scale", "cpu", *extra, "--override", "seed=5", "--workdir",
                   str(tmp_path / "x"), "--launcher", "print") == 1
        assert f"--override=seed=5 conflicts with the seed of row {row} (--base_seeds, --seeds)" in (
            capsys.readouterr().err)
    assert run("--rows", "E", "--scale", "cpu", "--launcher", "slurm", "--override", "seed=5", "--workdir",
               str(tmp_path / "slurm")) == 0
    script = (tmp_path / "slurm" / "sweep.sbatch").read_text()
    assert "--rows=base,E-learned-pos --base_seeds=1 --seeds=1" in script  # every task rebuilds these rows
    assert run("--grid", "model.num_heads=2,4", "--base_seeds", "2", "--workdir", str(tmp_path / "g")) == 1


def test_a_workdir_that_cannot_be_written_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    runner = FakeRunner()
    monkeypatch.setattr(launchers, "run_command", runner)
    with unwritable_folders(tmp_path) as cases:
        for folder, reason in cases:
            for launcher in ("local", "slurm"):
                assert run("--rows", "E", "--scale", "cpu", "--base_seeds", "1", "--workdir", folder,
                           "--launcher", launcher) == 1
                assert capsys.readouterr().err.splitlines()[0] == (
                    f"error: --workdir={folder}: {reason}; choose another --workdir")
    assert runner.commands == []


def test_report_reads_rows_run_by_hand(tmp_path, capsys):
    """After --launcher print, the user runs the commands: no result.json, but the report finds them."""
    args = ["--rows", "E", "--scale", "cpu", "--base_seeds", "1", "--workdir", str(tmp_path),
            "--launcher", "print"]
    assert run(*args) == 0
    runner = FakeRunner()
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("python train.py"):
            train, evaluate = line.split(" && ")
            runner(train.split(), "unused.log")
            runner(evaluate.split(), "unused.log")
    rows = sweep_report.build_report(str(tmp_path))["rows"]
    assert [(r["row"], r["status"], r["steps"]) for r in rows] == [("base", "done", CPU_STEPS),
                                                                   ("E-learned-pos", "done", CPU_STEPS)]
    assert rows[1]["changes"] == "position_encoding=learned"

    grid_dir = tmp_path / "grid"
    assert run("--grid", "model.num_heads=2,4 data.length_buckets=(16,64)", "--workdir",
               str(grid_dir), "--launcher", "slurm", "--slurm_option=--gres=gpu:1") == 0
    script = (grid_dir / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-1" in script and "#SBATCH --gres=gpu:1" in script
    assert '--row_index="$SLURM_ARRAY_TASK_ID"' in script
    assert "--config=configs/default.py" in script and "sbatch" in capsys.readouterr().out
    assert "model.num_heads=4,data.length_buckets=(16,64)" in script


def test_print_grid_commands_carry_the_overrides(tmp_path, capsys):
    assert run("--grid", "model.dropout_rate=0.0 data.length_buckets=(16,64)", "--workdir",
               str(tmp_path), "--launcher", "print") == 0
    out = capsys.readouterr().out
    assert "--config.model.dropout_rate=0.0 '--config.data.length_buckets=(16,64)'" in out




def test_the_command_line_takes_its_subcommand():
    """``python -m transformer_jax.sweep params ...`` as a user types it: the subcommand is not rejected."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "transformer_jax.sweep", "params", "--scale", "cpu",
                           "--rows", "C"], cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| C-dff4096 | d_ff=512 |" in done.stdout


def test_sweep_errors_are_one_line_and_the_hint(tmp_path, capsys):
    assert run("--grid", "model.num_heads=x", "--workdir", str(tmp_path / "s")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("error: "), err
    assert err[1] == "(set TRANSFORMER_JAX_TRACEBACK=1 for the traceback)"


def _array_task_argv(script: str, task_id: int) -> list[str]:
    """The sweep arguments array task ``task_id`` of a written ``sweep.sbatch`` runs."""
    (line,) = [line for line in script.splitlines() if "$SLURM_ARRAY_TASK_ID\"" in line and "-m" in line]
    argv = shlex.split(line.removesuffix(" &").replace("$SLURM_ARRAY_TASK_ID", str(task_id)))
    return argv[argv.index("transformer_jax.sweep") + 1:]


def test_a_slurm_array_of_one_row_index_runs_that_row(tmp_path, monkeypatch, capsys):
    """``--launcher slurm --row_index k``: the array's one task is k, and it trains row k of the full grid."""
    assert run("--grid", "model.dropout_rate=0.0,0.1,0.2", "--row_index", "2", "--workdir",
               str(tmp_path / "g"), "--launcher", "slurm") == 0
    script = (tmp_path / "g" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=2\n" in script and "#   2: model.dropout_rate=0.2" in script
    assert "rows=(model.dropout_rate=0.0 model.dropout_rate=0.1 model.dropout_rate=0.2)" in script
    assert "(1 array tasks)" in capsys.readouterr().out

    runner = FakeRunner()
    monkeypatch.setattr(launchers, "run_command", runner)
    assert run("--rows", "E", "--scale", "cpu", "--base_seeds", "1", "--row_index", "1", "--workdir",
               str(tmp_path / "t3"), "--launcher", "slurm") == 0
    script = (tmp_path / "t3" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=1\n" in script and "#   1: E-learned-pos" in script
    assert run(*_array_task_argv(script, 1)) == 0  # what task 1 runs
    assert runner.commands == [("train.py", "E-learned-pos"), ("evaluate.py", "E-learned-pos")]


# Sixteen single-value items: their names joined are 400 bytes, more than a folder name takes (255).
LONG_GRID = ("seed=3 log_every_steps=10 eval_every_steps=20 eval_bleu_examples=3 final_beam_size=1 "
             "final_alpha=0.0 final_max_extra_len=5 checkpoint_every_steps=10 checkpoint_every_minutes=5.0 "
             "checkpoint_keep=2 profile_num_steps=1 model.dropout_rate=0.1 model.attention_dropout_rate=0.1 "
             "profile_start_step=0 dev_bleu_protocol=tokenized final_eval_split=dev,test")


def _finished_run(command, log_path) -> int:
    """A fake train.py or evaluate.py of any row: the final metrics record, or its dev score."""
    row_dir = next(a.split("=", 1)[1] for a in command if a.startswith("--workdir="))
    os.makedirs(os.path.join(row_dir, "eval"), exist_ok=True)
    if command[1] == "train.py":
        with open(os.path.join(row_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": 10**9, "train_seconds": 1.0}) + "\n")
    else:
        with open(os.path.join(row_dir, "eval", f"dev-{10**9}.json"), "w") as f:
            json.dump({"step": 10**9, "ppl": 9.0, "tokenized_bleu": 1.0, "sacrebleu": 1.0, "beam_size": 4,
                       "num_sentences": 200}, f)
    return 0


def test_a_grid_of_many_items_names_its_rows_so_they_are_folders(tmp_path, monkeypatch):
    rows = grid.parse_grid(LONG_GRID, "configs/default.py")
    assert [r.name.rsplit("-", 1)[0] for r in rows] == ["final_eval_split=dev", "final_eval_split=test"]
    assert len({r.name for r in rows}) == 2 and all(len(r.name.encode()) <= 200 for r in rows)
    assert len(rows[0].changes) == 16  # the report still shows every value
    for row in rows:
        (tmp_path / row.name).mkdir()  # each is a folder name
    monkeypatch.setattr(launchers, "run_command", _finished_run)
    assert run("--grid", LONG_GRID, "--workdir", str(tmp_path / "s")) == 0
    assert sorted(os.listdir(tmp_path / "s")) == sorted(["sweep.json", *(r.name for r in rows)])
    # A short name is kept as it was, so that sweeps launched before go on in the same folders.
    assert [r.name for r in grid.parse_grid("model.num_heads=2,4", "configs/default.py")] == [
        "model.num_heads=2", "model.num_heads=4"]


def test_a_row_name_that_cannot_be_a_folder_fails_before_anything_is_written(tmp_path):
    rows = grid.parse_grid("model.num_heads=2", "configs/default.py")
    for name in ("x" * 300, "a/b", ".."):
        with pytest.raises(ValueError, match="cannot be a folder name"):
            grid.validate_rows([grid.Row(name, rows[0].config_arg)])
    with pytest.raises(ValueError, match="two sweep rows are named"):
        grid.validate_rows([rows[0], rows[0]])


@pytest.mark.parametrize("content, problem", [
    ('{"row": "base", "dev_pp', "does not read (Unterminated string"),
    ("{}", "is not a result (it lacks step, dev_ppl, dev_bleu)"),
    ('{"step": 300, "dev_ppl": Infinity, "dev_bleu": NaN}', "holds no scores (dev_ppl=inf, dev_bleu=nan: "
                                                            "expected finite numbers; a run that diverged"),
])
def test_a_result_that_does_not_read_is_named_and_the_row_evaluated_again(tmp_path, monkeypatch, capsys,
                                                                          content, problem):
    workdir = tmp_path / "t3"
    runner = FakeRunner()
    monkeypatch.setattr(launchers, "run_command", runner)
    args = ["--grid", "table3", "--rows", "base", "--scale", "cpu", "--base_seeds", "1",
            "--workdir", str(workdir)]
    assert run(*args) == 0
    result = workdir / "base" / "result.json"
    result.write_text(content)  # e.g. cut by a full disk, or emptied by hand
    markdown = sweep_report.build_report(str(workdir))["markdown"]
    assert markdown.startswith(f"**Warning:** row base: {result} {problem}")
    assert "its scores are read from its metrics.jsonl and eval/ instead" in markdown  # evaluate.py's
    os.remove(workdir / "base" / "eval" / f"dev-{CPU_STEPS}.json")
    markdown = sweep_report.build_report(str(workdir))["markdown"]
    assert "; it counts as not finished" in markdown and "(0 of 1 rows finished)" in markdown
    runner.commands.clear()
    capsys.readouterr()
    assert run(*args) == 0
    assert runner.commands == [("evaluate.py", "base")]  # trained already: evaluated again
    assert f"[1/1] base: {result} {problem}" in capsys.readouterr().out
    assert json.loads(result.read_text())["dev_ppl"] > 0
