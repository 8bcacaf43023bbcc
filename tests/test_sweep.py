"""Tests for configs/table3.py and transformer_jax.sweep: rows, grids, resuming, the report.

Nothing here trains: the local launcher's subprocess runner is replaced by a fake that writes what
train.py and evaluate.py would (the final ``metrics.jsonl`` record and ``eval/dev-<step>.json``).
"""

import csv
import json
import os

import pytest

from configs import table3, wmt14_en_de_base
from transformer_jax import model, paper, sweep, train_lib

CPU_STEPS = table3.get_config("base,cpu").train.num_steps

# ---------------------------------------------------------------------------------------------------
# configs/table3.py


@pytest.mark.parametrize("scale", table3.SCALES)
def test_every_row_builds_a_valid_config(scale):
    for row in paper.TABLE3:
        config = table3.get_config(f"{row.name},{scale}")
        train_lib.validate_config(config)
        assert config.name == f"table3/{row.name}"
        hparams = row.config()
        m = config.model
        if scale == "paper":
            assert (m.d_model, m.d_ff, m.num_heads, m.d_k, m.d_v) == tuple(
                hparams[k] for k in ("d_model", "d_ff", "num_heads", "d_k", "d_v"))
            assert m.num_encoder_layers == m.num_decoder_layers == hparams["num_layers"]
            assert config.train.num_steps == hparams["train_steps"]
            assert config.data.source == "tfds"
        else:
            assert m.d_model * 8 == hparams["d_model"] and m.d_ff * 8 == hparams["d_ff"]
            assert m.num_heads == hparams["num_heads"] and m.d_k * 8 == hparams["d_k"]
            assert m.num_encoder_layers * 2 == hparams["num_layers"]
            num, den = table3.CPU_STEPS_FRACTION
            assert config.train.num_steps == hparams["train_steps"] * num // den
            assert config.data.source == "synthetic"
        assert m.dropout_rate == hparams["dropout_rate"]
        assert config.train.label_smoothing == hparams["label_smoothing"]
        assert m.position_encoding == hparams["position_encoding"]


def test_paper_base_row_is_the_base_config_unchanged():
    ours = table3.get_config("base").to_dict()
    theirs = wmt14_en_de_base.get_config().to_dict()
    assert ours.pop("name") == "table3/base"
    theirs.pop("name")
    assert ours == theirs


def test_cpu_scale_keeps_relative_changes():
    cfg = {name: table3.get_config(f"{name},cpu").model for name in
           ("base", "C-dmodel256", "C-dmodel1024", "A-heads32", "C-layers2", "C-layers4", "C-layers8")}
    assert (cfg["base"].d_model, cfg["base"].d_ff, cfg["base"].num_heads, cfg["base"].d_k) == (64, 256, 8, 8)
    assert (cfg["C-dmodel256"].d_model, cfg["C-dmodel256"].d_k) == (32, 4)
    assert cfg["C-dmodel1024"].d_model == 128
    assert (cfg["A-heads32"].num_heads, cfg["A-heads32"].d_k) == (32, 2)
    assert [cfg[f"C-layers{n}"].num_encoder_layers for n in (2, 4, 8)] == [1, 2, 4]
    assert table3.get_config("big,cpu").train.num_steps == 3 * table3.get_config("base,cpu").train.num_steps


def test_config_argument_errors_list_the_choices():
    with pytest.raises(ValueError, match="valid rows: base, A-heads1"):
        table3.get_config("C-dmodel257")
    with pytest.raises(ValueError, match="valid scales: paper, cpu"):
        table3.get_config("base,gpu")
    with pytest.raises(ValueError, match="<row>"):
        table3.get_config("base,cpu,extra")
    assert table3.get_config(None).name == "table3/base"


def test_row_fields_must_exist_in_the_locked_config():
    config = table3.get_config("base")
    with pytest.raises(ValueError, match="no config field"):
        table3.apply_hparams(config, {"num_layer": 3})
    with pytest.raises(AttributeError):
        config.model.d_modle = 3  # the config is locked: a typo cannot add a field


# ---------------------------------------------------------------------------------------------------
# Row selection and generic grids.


def _names(rows):
    return [r.name for r in rows]


def test_select_rows_by_group_and_name():
    assert _names(sweep.select_table3_rows("A")) == ["A-heads1", "A-heads4", "A-heads16", "A-heads32"]
    assert _names(sweep.select_table3_rows("E,base,D-ls0.2")) == ["base", "D-ls0.2", "E-learned-pos"]
    assert _names(sweep.select_table3_rows("big")) == ["big"]
    assert len(sweep.select_table3_rows(None)) == 20
    with pytest.raises(ValueError, match=r"'F'.*groups: base, A, B, C, D, E, big.*rows: base, A-heads1"):
        sweep.select_table3_rows("A,F")


def test_table3_rows_carry_scaled_changes():
    rows = {r.name: r for r in sweep.table3_rows("C-dmodel256,big", "cpu")}
    assert dict(rows["C-dmodel256"].changes) == {"d_model": 32, "d_k": 4, "d_v": 4}
    assert dict(rows["big"].changes)["train_steps"] == 900
    assert rows["big"].config_arg == "configs/table3.py:big,cpu"


def test_grid_is_a_typed_cartesian_product():
    rows = sweep.parse_grid("model.num_heads=1,4,8 model.dropout_rate=0.0,0.1", "configs/default.py")
    assert len(rows) == 6
    assert rows[3].name == "model.num_heads=4,model.dropout_rate=0.1"
    assert rows[3].overrides == (("model.num_heads", 4), ("model.dropout_rate", 0.1))
    assert all(isinstance(dict(r.overrides)["model.num_heads"], int) for r in rows)
    assert all(isinstance(dict(r.overrides)["model.dropout_rate"], float) for r in rows)
    rows = sweep.parse_grid(
        "data.length_buckets=(32,64),(64,) model.attention_witness=true model.position_encoding=learned",
        "configs/default.py")
    assert [dict(r.overrides)["data.length_buckets"] for r in rows] == [(32, 64), (64,)]
    assert dict(rows[0].overrides)["model.attention_witness"] is True
    assert rows[1].name == ("data.length_buckets=(64,),model.attention_witness=true,"
                            "model.position_encoding=learned")
    config = sweep.build_config(rows[1])
    assert config.data.length_buckets == (64,) and config.model.position_encoding == "learned"


@pytest.mark.parametrize("spec, message", [
    ("model.num_head=1,2", r"unknown config key 'model.num_head'.*its fields: .*num_heads"),
    ("modle.num_heads=1", r"the config has no field 'modle'"),
    ("model=1", r"is a section"),
    ("model.num_heads=4,four", r"bad value model.num_heads='four': expected an int"),
    ("model.num_heads=1.5", r"expected an int"),
    ("model.dropout_rate=high", r"expected a float"),
    ("data.length_buckets=16", r"expected tuple"),
    ("model.num_heads", r"expected key=value1,value2"),
    ("model.num_heads=1 model.num_heads=2", r"appears twice"),
])
def test_bad_grid_specs_fail(spec, message):
    with pytest.raises(ValueError, match=message):
        sweep.parse_grid(spec, "configs/default.py")


def test_invalid_model_fails_before_anything_trains(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(sweep, "_run_command", lambda command, log: calls.append(command) or 0)
    rows = sweep.parse_grid("model.num_heads=4,3", "configs/default.py")  # d_model=128: 3 does not divide
    with pytest.raises(ValueError, match=r"row 'model.num_heads=3'.*not divisible by num_heads=3"):
        sweep.validate_rows(rows)
    code = sweep.main(["--grid", "model.num_heads=4,3", "--workdir", str(tmp_path / "s")])
    assert code == 2 and calls == []
    assert "not divisible" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # nothing was written either
    assert sweep.main(["--grid", "model.num_heads=x", "--workdir", str(tmp_path / "s")]) == 2
    assert sweep.main(["--grid", "table3", "--rows", "A-heads3", "--workdir", str(tmp_path / "s")]) == 2
    assert calls == []


# ---------------------------------------------------------------------------------------------------
# The local launcher: skipping and resuming, with a fake train.py / evaluate.py.


class FakeRunner:
    """Stands in for ``sweep._run_command``: records commands, writes what the real scripts write."""

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
        num_steps = table3.get_config(f"{row},cpu").train.num_steps
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
    monkeypatch.setattr(sweep, "_run_command", runner)
    args = ["--grid", "table3", "--rows", "A-heads1,A-heads4,E", "--scale", "cpu",
            "--workdir", str(workdir)]
    # A half-finished sweep: base done, A-heads1 trained but not evaluated.
    (workdir / "base").mkdir(parents=True)
    (workdir / "base" / "result.json").write_text(json.dumps({"dev_ppl": 9.0}))
    (workdir / "A-heads1").mkdir()
    (workdir / "A-heads1" / "metrics.jsonl").write_text(
        json.dumps({"step": CPU_STEPS, "train_seconds": 30.0}) + "\n")

    assert sweep.main(args) == 1  # A-heads4 was preempted: not finished yet
    out = capsys.readouterr().out
    assert "Adding the base row" in out and "base: done already" in out
    assert runner.commands == [("evaluate.py", "A-heads1"), ("train.py", "A-heads4"),
                               ("train.py", "E-learned-pos"), ("evaluate.py", "E-learned-pos")]
    assert "preempted?" in out and "failed: A-heads4" in out
    assert not (workdir / "A-heads4" / "result.json").exists()
    result = json.loads((workdir / "E-learned-pos" / "result.json").read_text())
    assert result["step"] == CPU_STEPS and result["dev_bleu"] == 20.0 and result["beam_size"] == 1
    assert result["changes"] == {"position_encoding": "learned"}

    runner.commands.clear()
    assert sweep.main(args) == 0  # resumes A-heads4 only
    assert runner.commands == [("train.py", "A-heads4"), ("evaluate.py", "A-heads4")]
    attempts = json.loads((workdir / "A-heads4" / "result.json").read_text())["attempts"]
    assert attempts == 2

    runner.commands.clear()
    assert sweep.main(args) == 0
    assert runner.commands == []  # everything finished: all skipped
    manifest = json.loads((workdir / "sweep.json").read_text())
    assert [r["name"] for r in manifest["rows"]] == ["base", "A-heads1", "A-heads4", "E-learned-pos"]


def test_a_crashing_row_does_not_stop_the_sweep(tmp_path, monkeypatch):
    runner = FakeRunner(fail={"D-ls0.0"})
    monkeypatch.setattr(sweep, "_run_command", runner)
    assert sweep.main(["--rows", "D-ls0.0,D-ls0.2", "--scale", "cpu", "--workdir", str(tmp_path)]) == 1
    assert ("train.py", "D-ls0.2") in runner.commands
    assert (tmp_path / "D-ls0.2" / "result.json").exists()
    assert not (tmp_path / "D-ls0.0" / "result.json").exists()


def test_a_workdir_holds_one_sweep(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "_run_command", FakeRunner())
    assert sweep.main(["--rows", "base", "--scale", "cpu", "--workdir", str(tmp_path)]) == 0
    assert sweep.main(["--rows", "base", "--scale", "paper", "--workdir", str(tmp_path),
                       "--launcher", "print"]) == 2


def test_print_and_slurm_launchers(tmp_path, capsys):
    assert sweep.main(["--rows", "C-dmodel256", "--scale", "cpu", "--workdir", str(tmp_path),
                       "--launcher", "print"]) == 0
    out = capsys.readouterr().out
    assert out.count("train.py --config=configs/table3.py:") == 2  # base is added
    assert "--config=configs/table3.py:C-dmodel256,cpu" in out and "evaluate.py" in out
    assert "--split=dev --beam_size=1" in out and "(paper x10^6: 28)" in out


def test_report_reads_rows_run_by_hand(tmp_path, capsys):
    """After --launcher print, the user runs the commands: no result.json, but the report finds them."""
    args = ["--rows", "E", "--scale", "cpu", "--workdir", str(tmp_path), "--launcher", "print"]
    assert sweep.main(args) == 0
    runner = FakeRunner()
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("python train.py"):
            train, evaluate = line.split(" && ")
            runner(train.split(), "unused.log")
            runner(evaluate.split(), "unused.log")
    markdown = sweep.write_report(str(tmp_path))["markdown"]
    assert "2 of 2 rows finished" in markdown and "| E-learned-pos | position_encoding=learned" in markdown

    grid_dir = tmp_path / "grid"
    assert sweep.main(["--grid", "model.num_heads=2,4 data.length_buckets=(16,64)", "--workdir",
                       str(grid_dir), "--launcher", "slurm", "--slurm_option=--gres=gpu:1"]) == 0
    script = (grid_dir / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-1" in script and "#SBATCH --gres=gpu:1" in script
    assert '--row_index="$SLURM_ARRAY_TASK_ID"' in script
    assert "--config=configs/default.py" in script and "sbatch" in capsys.readouterr().out
    assert "model.num_heads=4,data.length_buckets=(16,64)" in script


def test_print_grid_commands_carry_the_overrides(tmp_path, capsys):
    assert sweep.main(["--grid", "model.dropout_rate=0.0 data.length_buckets=(16,64)", "--workdir",
                       str(tmp_path), "--launcher", "print"]) == 0
    out = capsys.readouterr().out
    assert "--config.model.dropout_rate=0.0 '--config.data.length_buckets=(16,64)'" in out


# ---------------------------------------------------------------------------------------------------
# Parameter counts and the report.


def test_params_subcommand_prints_every_paper_row(capsys):
    assert sweep.main(["params"]) == 0
    out = capsys.readouterr().out
    for row in paper.TABLE3:
        count = model.param_count(model.config_from_hparams(row.config(), paper.VOCAB_EN_DE))
        theirs = "—" if row.params_millions is None else str(row.params_millions)
        assert f"| {row.name} | " in out and f"| {count:,} | {count / 1e6:.1f} | {theirs} |" in out


def test_direction_uses_one_rule_for_both():
    assert sweep.direction(5.29, 4.92, "ppl") == "up"
    assert sweep.direction(4.91, 4.92, "ppl") == "flat"  # A-heads16: within 1%
    assert sweep.direction(4.67, 4.92, "ppl") == "down"
    assert sweep.direction(25.7, 25.8, "bleu") == "flat"
    assert sweep.direction(25.4, 25.8, "bleu") == "down"


def _fake_sweep(workdir, results):
    rows = sweep.table3_rows(",".join(results), "cpu")
    info = sweep.validate_rows(rows)
    sweep.write_manifest(str(workdir), grid="table3", scale="cpu", config_arg=None, rows=rows, info=info)
    for name, (ppl, bleu) in results.items():
        if ppl is None:
            continue
        (workdir / name).mkdir()
        (workdir / name / "result.json").write_text(json.dumps(
            {"row": name, "step": 300, "dev_ppl": ppl, "dev_bleu": bleu, "dev_sacrebleu": bleu - 1,
             "wall_seconds": 95.0}))


def test_report_from_fake_results(tmp_path, capsys):
    _fake_sweep(tmp_path, {"base": (10.0, 20.0), "A-heads1": (11.0, 18.0), "D-ls0.0": (10.5, 20.1),
                           "E-learned-pos": (10.02, 20.0), "big": (None, None)})
    assert sweep.main(["report", "--workdir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    markdown = (tmp_path / "report.md").read_text()
    assert markdown in printed
    assert "absolute values are not comparable" in markdown and "4 of 5 rows finished" in markdown
    lines = {line.split("|")[1].strip(): line for line in markdown.splitlines() if line.startswith("| ")}
    assert "| 65 | 10.00 | 4.92 | 20.00 | 25.8 | 300 | 1.6 min |" in lines["base"]
    assert "| 63.0 |" in lines["base"]  # exact count at paper scale, beside the paper's 65
    assert "— / 900" in lines["big"]
    # Direction table: A-heads1 PPL up (paper up), D-ls0.0 PPL up (paper down), E flat (paper flat).
    directions = [line for line in markdown.splitlines() if line.startswith("| A-heads1 | num_heads")]
    assert "up (+10.0%) | up (+7.5%) | agrees" in directions[-1]
    assert "down (-2.00) | down (-0.9) | agrees" in directions[-1]
    d_ls = [line for line in markdown.splitlines() if line.startswith("| D-ls0.0 |")][-1]
    assert "up (+5.0%) | down (-5.1%) | differs" in d_ls
    e = [line for line in markdown.splitlines() if line.startswith("| E-learned-pos |")][-1]
    assert "flat (+0.2%) | flat (+0.0%) | agrees" in e
    assert "PPL direction agrees with the paper on 2 of 3 rows; BLEU direction on 2 of 3" in markdown

    with open(tmp_path / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["row"] for r in rows] == ["base", "A-heads1", "D-ls0.0", "E-learned-pos", "big"]
    assert float(rows[1]["dev_ppl"]) == 11.0 and rows[1]["paper_ppl_vs_base"] == "up"
    assert rows[4]["status"] == "not finished"
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_without_base_says_so(tmp_path):
    _fake_sweep(tmp_path, {"A-heads1": (11.0, 18.0)})
    markdown = sweep.write_report(str(tmp_path))["markdown"]
    assert "No finished base row" in markdown
    assert (tmp_path / "report.png").stat().st_size > 5_000


def test_generic_grid_report(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "_run_command", FakeRunnerGrid())
    assert sweep.main(["--grid", "model.num_heads=2,4", "--config", "configs/table3.py:base,cpu",
                       "--workdir", str(tmp_path)]) == 0
    markdown = sweep.write_report(str(tmp_path))["markdown"]
    assert "| model.num_heads=2 |" in markdown and "| model.num_heads=4 |" in markdown
    assert "paper PPL" not in markdown


class FakeRunnerGrid(FakeRunner):
    def __call__(self, command, log_path):
        row_dir = next(a.split("=", 1)[1] for a in command if a.startswith("--workdir="))
        if command[1] == "train.py":
            with open(os.path.join(row_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": 400, "train_seconds": 1.0}) + "\n")
        else:
            os.makedirs(os.path.join(row_dir, "eval"), exist_ok=True)
            with open(os.path.join(row_dir, "eval", "dev-400.json"), "w") as f:
                json.dump({"step": 400, "ppl": 9.0, "tokenized_bleu": 1.0, "sacrebleu": 1.0,
                           "beam_size": 4, "num_sentences": 200}, f)
        return 0


def test_bleu_directions_need_a_base_that_translates(tmp_path):
    _fake_sweep(tmp_path, {"base": (13.0, 0.0), "D-ls0.2": (14.0, 0.0)})
    markdown = sweep.write_report(str(tmp_path))["markdown"]
    line = [line for line in markdown.splitlines() if line.startswith("| D-ls0.2 |")][-1]
    assert "up (+7.7%) | up (+11.2%) | agrees | flat (+0.00) | flat (-0.1) | not compared |" in line
    assert "BLEU directions are not compared: the base row's dev BLEU is 0.00" in markdown
