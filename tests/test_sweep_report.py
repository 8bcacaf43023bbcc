"""Tests for transformer_jax.sweep.report (and the ``params`` command): tables, directions, CSV, PNG.

Sweeps are faked: a manifest and each row's ``result.json`` (or train.py / evaluate.py outputs) written
directly, nothing trained.
"""

import csv
import json
import os

import matplotlib.axes
import numpy as np
import pytest
from test_sweep import FakeRunner, run

from configs import table3
from transformer_jax.evaluation import paper_tables
from transformer_jax.run_config import build_run_config
from transformer_jax.sweep import grid, launchers, report


def _cells(markdown: str, row: str) -> list[list[str]]:
    """The cells of every markdown table line whose first cell is ``row`` (main table, then directions)."""
    out = []
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] == row:
            out.append(cells)
    return out


def test_params_command_counts_by_hand(capsys):
    assert run("params", "--scale", "cpu", "--rows", "base,C-layers2") == 0
    lines = {cells[0]: cells for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
        if line.startswith("| "))}
    # d_model 64, d_ff 256, h 8, d_k = d_v = 8, 1000 shared tokens:
    # encoder layer 4*64*64 + (2*64*256 + 256 + 64) + 2*128 = 49,728; decoder layer 66,240; embedding 64,000.
    assert lines["base"][2:] == ["411,904", "0.4", "65"]  # 3 x (49,728 + 66,240) + 64,000
    assert lines["C-layers2"][1:3] == ["num_encoder_layers=1, num_decoder_layers=1", "179,968"]  # N=1


def test_direction_uses_one_rule_for_both():
    assert report.direction(5.29, 4.92, "ppl") == "up"
    assert report.direction(4.91, 4.92, "ppl") == "flat"  # A-heads16: within 1%
    assert report.direction(4.67, 4.92, "ppl") == "down"
    assert report.direction(25.7, 25.8, "bleu") == "flat"
    assert report.direction(25.4, 25.8, "bleu") == "down"


def _fake_sweep(workdir, results, base_seeds=1, seeds=1):
    rows = grid.table3_rows(",".join(r for r in results if "-seed" not in r), "cpu", base_seeds, seeds=seeds)
    info = grid.validate_rows(rows)
    launchers.write_manifest(str(workdir), grid="table3", scale="cpu", config_arg=None, rows=rows, info=info)
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
    assert run("report", "--workdir", str(tmp_path)) == 0
    markdown = (tmp_path / "report.md").read_text()
    assert markdown in capsys.readouterr().out
    # Main table: row, changes, params, at paper scale (x10^6), paper (x10^6), dev PPL, paper PPL,
    # dev BLEU, paper BLEU, steps, wall.
    base = _cells(markdown, "base")[0]
    assert base[2:] == ["411,904", "63.0", "65", "10.00", "4.92", "20.00", "25.8", "300", "1.6 min"]
    big = _cells(markdown, "big")[0]
    assert big[3:5] == ["214.2", "213"] and big[9] == "— / 900"  # unfinished: steps of the budget
    # Direction table: row, changes, PPL vs base, paper, verdict, BLEU vs base, paper, verdict.
    # A-heads1: PPL 10 -> 11 (+10%; paper 4.92 -> 5.29, +7.5%), BLEU 20 -> 18 (paper 25.8 -> 24.9).
    assert _cells(markdown, "A-heads1")[-1][2:] == [
        "up (+10.0%)", "up (+7.5%)", "agrees", "down (-2.00)", "down (-0.9)", "agrees"]
    # D-ls0.0: PPL up here (+5%) but down in the paper (4.92 -> 4.67, -5.1%); BLEU 20.1 is within the
    # one-seed band (20 +- 0.25).
    assert _cells(markdown, "D-ls0.0")[-1][2:] == [
        "up (+5.0%)", "down (-5.1%)", "differs", "within noise (+0.10)", "down (-0.5)", "within noise"]
    assert _cells(markdown, "E-learned-pos")[-1][2:5] == ["within noise (+0.2%)", "flat (+0.0%)",
                                                          "within noise"]
    assert "one base seed, so the band is its value +- 1% PPL / 0.25 BLEU" in markdown

    with open(tmp_path / "report.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["row"] for r in rows] == ["base", "A-heads1", "D-ls0.0", "E-learned-pos", "big"]
    assert [r["status"] for r in rows] == ["done"] * 4 + ["not finished"]
    assert float(rows[1]["dev_ppl"]) == 11.0 and rows[1]["paper_ppl_vs_base"] == "up"
    assert [r["ppl_verdict"] for r in rows[1:4]] == ["agrees", "differs", "within noise"]
    assert [r["bleu_verdict"] for r in rows[1:4]] == ["agrees", "within noise", "within noise"]
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_diverged_row_is_named_and_the_report_is_written_whole(tmp_path, capsys):
    _fake_sweep(tmp_path, {"base": (10.0, 20.0), "A-heads1": (float("nan"), 18.0),
                           "A-heads4": (float("inf"), 19.0)})
    (tmp_path / "report.png").write_text("an earlier report's plot")
    assert run("report", "--workdir", str(tmp_path)) == 0
    markdown = (tmp_path / "report.md").read_text()
    for row, value in (("A-heads1", "nan"), ("A-heads4", "inf")):
        warning = (f"**Warning:** row {row}: {tmp_path / row / 'result.json'} holds no scores "
                   f"(dev_ppl={value}: expected finite numbers; a run that diverged has none); it counts as "
                   "not finished")
        assert warning in markdown
    assert "(1 of 3 rows finished)" in markdown
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn anew
    assert sorted(os.listdir(tmp_path)) == ["A-heads1", "A-heads4", "base", "report.csv", "report.md",
                                            "report.png", "sweep.json"]


def test_a_plot_that_fails_replaces_none_of_the_report(tmp_path, monkeypatch):
    _fake_sweep(tmp_path, {"base": (10.0, 20.0)})
    for ext in ("md", "csv", "png"):
        (tmp_path / f"report.{ext}").write_text("earlier")

    def fail(report_, path):
        open(path, "w").close()
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(report.report_plot, "plot_report", fail)
    with pytest.raises(RuntimeError, match="the plot failed"):
        report.write_report(str(tmp_path))
    assert [(tmp_path / f"report.{ext}").read_text() for ext in ("md", "csv", "png")] == ["earlier"] * 3
    assert sorted(os.listdir(tmp_path)) == ["base", "report.csv", "report.md", "report.png", "sweep.json"]


@pytest.mark.parametrize("manifest, problem", [
    ('{"grid": "table3", "rows": [', "does not read (JSONDecodeError: "),
    ("[]", "is not a sweep's manifest: a JSON list, not an object"),
    ('{"grid": "table3", "rows": []}', "is not a sweep's manifest: it lacks scale, config"),
    ('{"grid": "table3", "scale": "cpu", "config": null, "rows": [{"name": "base"}]}',
     "is not a sweep's manifest: row base has no changes, params, num_steps"),
    ('{"grid": "table3", "scale": "cpu", "config": null, "rows": [{"name": "Z", "changes": {}, "params": 1, '
     '"num_steps": 5}]}', "is not a sweep's manifest: row Z names no Table 3 row"),
])
def test_a_malformed_manifest_is_one_line_naming_it_in_report_and_launch(tmp_path, capsys, manifest, problem):
    (tmp_path / "sweep.json").write_text(manifest)
    launch = ("--rows", "base", "--scale", "cpu", "--base_seeds", "1", "--launcher", "print")
    for args in (("report",), launch):
        assert run(*args, "--workdir", str(tmp_path)) == 1
        err = capsys.readouterr().err.splitlines()
        assert err[0].startswith(f"error: {tmp_path / 'sweep.json'} {problem}") and len(err) == 2, err
        assert err[0].endswith("; move it away and launch the sweep again to write it anew (finished rows "
                               "keep their result.json and are not run again)")
    assert sorted(os.listdir(tmp_path)) == ["sweep.json"]


def test_report_without_base_has_no_direction_table(tmp_path):
    _fake_sweep(tmp_path, {"A-heads1": (11.0, 18.0)})
    result = report.write_report(str(tmp_path))
    assert len(_cells(result["markdown"], "A-heads1")) == 2  # the main table and the seeds' band only
    assert "### Direction of each change" not in result["markdown"]
    assert (tmp_path / "report.png").stat().st_size > 5_000


def test_generic_grid_report(tmp_path, monkeypatch):
    monkeypatch.setattr(launchers, "run_command", FakeRunnerGrid())
    assert run("--grid", "model.num_heads=2,4", "--config", "configs/table3.py:base,cpu",
               "--workdir", str(tmp_path)) == 0
    markdown = report.write_report(str(tmp_path))["markdown"]
    header = next(line for line in markdown.splitlines() if line.startswith("| row"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "row", "params", "dev PPL", "dev BLEU", "steps", "wall"]  # no paper columns
    # d_model 64 at 1000 tokens; h changes no parameter count.
    assert _cells(markdown, "model.num_heads=2")[0][1:4] == ["411,904", "9.00", "1.00"]
    assert _cells(markdown, "model.num_heads=4")[0][1] == "411,904"


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
    markdown = report.write_report(str(tmp_path))["markdown"]
    assert _cells(markdown, "D-ls0.2")[-1][2:] == [
        "up (+7.7%)", "up (+11.2%)", "agrees", "within noise (+0.00)", "flat (-0.1)", "not compared"]


def test_noise_band_is_the_spread_of_the_base_seeds(tmp_path):
    # Base seeds: PPL 10.0, 10.4, 10.2 (mean 10.2, band 10.0-10.4); BLEU 20.0, 19.0, 21.0 (mean 20, 19-21).
    _fake_sweep(tmp_path, {"base": (10.0, 20.0), "base-seed1": (10.4, 19.0), "base-seed2": (10.2, 21.0),
                           "A-heads1": (10.5, 18.5), "A-heads4": (10.3, 21.5), "D-ls0.0": (9.9, 20.5)},
                base_seeds=3)
    result = report.build_report(str(tmp_path))
    markdown = result["markdown"]
    assert [r["row"] for r in result["rows"]] == [
        "base", "base-seed1", "base-seed2", "A-heads1", "A-heads4", "D-ls0.0"]
    assert result["noise"] == {"seeds": 3, "base_ppl": 10.2, "base_bleu": 20.0,
                               "ppl_band": (10.0, 10.4), "bleu_band": (19.0, 21.0)}
    # A-heads1: 10.5 > 10.4 (+2.9% on 10.2); paper 5.29 vs 4.92 up: agrees. BLEU 18.5 < 19: down, agrees.
    assert _cells(markdown, "A-heads1")[-1][2:] == [
        "up (+2.9%)", "up (+7.5%)", "agrees", "down (-1.50)", "down (-0.9)", "agrees"]
    # A-heads4: PPL 10.3 inside 10.0-10.4; BLEU 21.5 > 21 is up, but the paper's 25.5 vs 25.8 is down.
    assert _cells(markdown, "A-heads4")[-1][2:] == [
        "within noise (+1.0%)", "up (+1.6%)", "within noise", "up (+1.50)", "down (-0.3)", "differs"]
    # D-ls0.0: PPL 9.9 < 10.0 is down, as in the paper (4.67); BLEU 20.5 inside 19-21.
    assert _cells(markdown, "D-ls0.0")[-1][2:5] == ["down (-2.9%)", "down (-5.1%)", "agrees"]
    # By group: A has 2 rows (PPL: 1 agrees, 1 within noise; BLEU: 1 agrees, 1 differs), D one.
    assert _cells(markdown, "A")[0][1:] == ["2", "1", "0", "1", "1", "1", "0"]
    assert _cells(markdown, "D")[0][1:] == ["1", "1", "0", "0", "0", "0", "1"]
    assert _cells(markdown, "all")[0][1:] == ["3", "2", "0", "1", "1", "1", "1"]
    assert "the spread of the base row's 3 seeds: dev PPL 10.00 to 10.40, dev BLEU 19.00 to 21.00" in markdown
    assert "only the direction of each change against the base row" in markdown
    assert report.write_report(str(tmp_path))["markdown"] == markdown
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_rows_beyond_the_paper_get_their_seed_band_and_no_paper_figures(tmp_path, monkeypatch):
    """E+ rows: their seeds' band in the report and as error bars in the plot; nothing of the paper's
    beside them; directions against the base row but never a verdict against the paper."""
    _fake_sweep(tmp_path, {"base": (10.0, 20.0), "base-seed1": (10.4, 19.0), "base-seed2": (10.2, 21.0),
                           "E-learned-pos": (10.1, 20.0), "E-learned-pos-seed1": (10.3, 20.4),
                           "E+-rotary-pos": (9.0, 23.0), "E+-rotary-pos-seed1": (9.4, 22.0),
                           "E+-no-pos": (14.0, 9.0), "E+-no-pos-seed1": (None, None)},
                base_seeds=3, seeds=2)
    bars = []  # what the plot draws: (heights, error bars) for the PPL axis, then the BLEU axis
    real_bar = matplotlib.axes.Axes.bar

    def recording_bar(ax, x, height, *args, **kwargs):
        bars.append((list(height), kwargs.get("yerr")))
        return real_bar(ax, x, height, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", recording_bar)
    markdown = report.write_report(str(tmp_path))["markdown"]
    bands = {b["row"]: b for b in report.build_report(str(tmp_path))["bands"]}
    assert list(bands) == ["base", "E-learned-pos", "E+-rotary-pos", "E+-no-pos"]
    rotary = bands["E+-rotary-pos"]
    assert (rotary["seeds"], rotary["dev_ppl_mean"], rotary["dev_ppl_min"], rotary["dev_ppl_max"]) == (
        2, pytest.approx(9.2), 9.0, 9.4)
    assert rotary["beyond_paper"] and rotary["paper_ppl"] is None and rotary["paper_bleu"] is None
    assert bands["E+-no-pos"]["seeds"] == 1 and bands["E+-no-pos"]["runs"] == 2  # one seed not finished
    # The band table: seeds, mean, band, the paper's (PPL then BLEU).
    assert _cells(markdown, "E-learned-pos")[1][1:] == ["2 of 2", "10.20", "10.10-10.30", "4.92",
                                                        "20.20", "20.00-20.40", "25.7"]
    assert _cells(markdown, "E+-rotary-pos")[1][1:] == ["2 of 2", "9.20", "9.00-9.40", "beyond the paper",
                                                        "22.50", "22.00-23.00", "beyond the paper"]
    # Directions: E+-rotary-pos's mean PPL 9.2 is below the base band (10.0-10.4), BLEU 22.5 above it.
    assert _cells(markdown, "E+-rotary-pos")[-1][2:] == [
        "down (-9.8%)", "beyond the paper", "beyond the paper", "up (+2.50)", "beyond the paper",
        "beyond the paper"]
    assert _cells(markdown, "E-learned-pos")[-1][2:5] == ["within noise (+0.0%)", "flat (+0.0%)",
                                                          "within noise"]
    # The group counts compare with the paper: E+ rows are not in them.
    assert not _cells(markdown, "E+") and _cells(markdown, "all")[0][1] == "1"
    assert "E+-rotary-pos, E+-no-pos (group E+) are **beyond the paper**" in markdown
    # No line of an E+ row carries a paper figure (base 4.92 / 25.8 / 65, row E's 4.92 / 25.7).
    for line in markdown.splitlines():
        if line.startswith("| E+-"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert not {"4.92", "25.8", "25.7", "65"} & set(cells), line
    with open(tmp_path / "report.csv") as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert rows["E+-rotary-pos-seed1"]["beyond_paper"] == "True" and rows["E+-rotary-pos"]["group"] == "E+"
    assert rows["E+-rotary-pos"]["paper_ppl"] == rows["E+-rotary-pos"]["paper_bleu"] == ""
    assert rows["E+-rotary-pos"]["ppl_verdict"] == "beyond the paper"
    assert float(rows["E+-rotary-pos-seed1"]["dev_bleu_max"]) == 23.0
    # The plot: one bar per row at its seeds' mean, error bars from its min to its max.
    (ppl_heights, ppl_errors), (bleu_heights, bleu_errors) = bars
    np.testing.assert_allclose(ppl_heights, [10.2, 10.2, 9.2, 14.0], atol=1e-9)
    np.testing.assert_allclose(ppl_errors, [[0.2, 0.1, 0.2, 0.0], [0.2, 0.1, 0.2, 0.0]], atol=1e-9)
    np.testing.assert_allclose(bleu_errors, [[1.0, 0.2, 0.5, 0.0], [1.0, 0.2, 0.5, 0.0]], atol=1e-9)
    png = tmp_path / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_evaluate_puts_no_paper_row_beside_a_row_beyond_the_paper():
    config = table3.get_config("E+-alibi-pos,cpu")
    run_config = build_run_config(config, environment=False)
    table = paper_tables.paper_comparison_table(config.name, "dev", {"tokenized_bleu": 30.0, "ppl": 5.0},
                                                run=run_config)
    assert "Row 'E+-alibi-pos' is beyond the paper (ALiBi, Press et al. 2021)" in table
    assert "25.7" not in table and "4.92" not in table
