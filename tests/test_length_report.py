"""Tests for transformer_jax.evaluation.length_report: the seeds of each scheme summarized per bucket."""

import json
import os

import pytest

from transformer_jax.evaluation import length_report
from transformer_jax.runtime import provenance
from transformer_jax.runtime.errors import UserError


def _run(scheme, seed, scores, seconds=120.0, ratios=(1.0, 0.8, 0.5)):
    buckets = [("1-16", 1, 16, "within"), ("17-32", 17, 32, "beyond"), ("33+", 33, None, "beyond")]
    rows = [{"bucket": b, "min_tokens": lo, "max_tokens": hi, "sentences": 10 * (i + 1), "score": s,
             "length_ratio": ratio, "training": t}
            for i, ((b, lo, hi, t), s, ratio) in enumerate(zip(buckets, scores, ratios, strict=True))]
    return {"scheme": scheme, "seed": seed, "train_max_len": 16, "train_seconds": seconds, "rows": rows}


def test_each_scheme_gets_its_seeds_mean_and_range_per_bucket():
    runs = [_run("rotary", 1, [80.0, 40.0, 10.0]), _run("rotary", 0, [70.0, 50.0, None], 180.0,
                                                         (0.9, 0.6, None)),
            _run("learned", 0, [75.0, 5.0, 0.0])]
    schemes = length_report.summarize(runs)
    assert list(schemes) == ["learned", "rotary"]
    rotary = schemes["rotary"]
    assert rotary["seeds"] == [0, 1] and rotary["minutes"] == [3.0, 2.0]
    assert rotary["mean"] == [75.0, 45.0, 10.0]  # an empty bucket counts no seed
    assert rotary["min"] == [70.0, 40.0, 10.0] and rotary["max"] == [80.0, 50.0, 10.0]
    table = length_report.markdown_table(schemes).splitlines()
    assert table[0] == "| scheme | seeds | 1-16 | 17-32 (beyond) | 33+ (beyond) | minutes per run |"
    assert table[2] == "| sentences | | 10 | 20 | 30 | |"
    assert table[4] == "| rotary | 2 | 75.0 (70.0-80.0) | 45.0 (40.0-50.0) | 10.0 (10.0-10.0) | 2.5 |"
    assert rotary["length_ratio_min"] == [0.9, 0.6, 0.5] and rotary["length_ratio_max"] == [1.0, 0.8, 0.5]
    ratios = length_report.length_ratio_table(schemes).splitlines()
    assert ratios[0] == "| scheme | 1-16 | 17-32 (beyond) | 33+ (beyond) |"
    assert ratios[3] == "| rotary | 0.90-1.00 | 0.60-0.80 | 0.50 |"


def test_runs_scored_on_other_buckets_are_refused():
    other = _run("rotary", 1, [1.0, 2.0, 3.0])
    other["rows"][0]["bucket"] = "1-10"
    with pytest.raises(UserError, match="was scored on the length buckets 1-10, 17-32, 33[+], the run of "
                       "rotary with seed 0 on 1-16"):
        length_report.summarize([_run("rotary", 0, [1.0, 2.0, 3.0]), other])


def test_a_bucket_no_seed_scored_is_a_dash_and_json_null():
    schemes = length_report.summarize([_run("rotary", 0, [70.0, 50.0, None], ratios=(0.9, 0.6, None)),
                                       _run("rotary", 1, [80.0, 40.0, None], ratios=(1.0, 0.8, None))])
    rotary = schemes["rotary"]
    assert rotary["mean"][2] is rotary["min"][2] is rotary["max"][2] is None
    assert rotary["length_ratio_min"][2] is None
    table = length_report.markdown_table(schemes).splitlines()
    assert table[3] == "| rotary | 2 | 75.0 (70.0-80.0) | 45.0 (40.0-50.0) | — | 2.0 |"
    ratios = length_report.length_ratio_table(schemes).splitlines()
    assert ratios[2] == "| rotary | 0.90-1.00 | 0.60-0.80 | — |"
    json.loads(json.dumps({"schemes": schemes}, allow_nan=False))  # what report.json holds: strict JSON


def test_runs_of_two_schemes_scored_on_other_buckets_are_refused_naming_both():
    other = _run("learned", 0, [1.0, 2.0, 3.0])
    for row, label in zip(other["rows"], ("1-10", "11-32", "33+"), strict=True):
        row["bucket"] = label
    with pytest.raises(UserError) as error:
        length_report.summarize([_run("rotary", 0, [1.0, 2.0, 3.0]), other])
    assert str(error.value).startswith(
        "the run of rotary with seed 0 was scored on the length buckets 1-16, 17-32, 33+, the run of learned "
        "with seed 0 on 1-10, 11-32, 33+; evaluate every run with the same --length_buckets")


class _Checkpoint:
    """Stands for the checkpoint reader of a workdir: its run config is all ``read_run`` asks of it."""

    def __init__(self, directory):
        self.directory = directory

    def saved_info(self):
        config = {"model": {"position_encoding": "rotary"}, "seed": 2, "data": {"max_len": 16}}
        return 6, config, {}


def _evaluated(tmp_path, monkeypatch, **records) -> str:
    """A workdir whose eval/ holds ``records`` (name -> JSON text), written one second apart in order."""
    monkeypatch.setattr(length_report, "CheckpointReader", _Checkpoint)
    (tmp_path / "eval").mkdir()
    for age, (name, text) in enumerate(reversed(records.items())):
        path = tmp_path / "eval" / f"{name}.json"
        path.write_text(text)
        os.utime(path, (1e9 - age, 1e9 - age))
    return str(tmp_path)


def _by_length(score: float, **extra) -> str:
    rows = _run("rotary", 2, [score, score, score])["rows"]
    return json.dumps({"bleu": score, "by_length": {"measure": "BLEU", "buckets": rows}, **extra})


def test_an_ensembles_scores_are_not_read_as_the_runs_own(tmp_path, monkeypatch):
    ensemble = _by_length(40.0, ensemble=[{"workdir": "a", "averaged_steps": [6]},
                                          {"workdir": "b", "averaged_steps": [6]}])
    workdir = _evaluated(tmp_path, monkeypatch,
                         **{"test-6": _by_length(30.0), "test-6-ens2-0a1b2c3d": ensemble})
    run = length_report.read_run(workdir)  # the ensemble's file is the newer one
    assert [r["score"] for r in run["rows"]] == [30.0, 30.0, 30.0] and run["scheme"] == "rotary"
    os.remove(os.path.join(workdir, "eval", "test-6.json"))
    with pytest.raises(UserError, match=r"with this run's scores by length \(1 scored an ensemble"):
        length_report.read_run(workdir)


def test_a_truncated_eval_json_is_one_line_naming_the_file(tmp_path, monkeypatch):
    workdir = _evaluated(tmp_path, monkeypatch,
                         **{"test-4": _by_length(30.0)[:50], "test-6": _by_length(31.0)})
    with pytest.raises(UserError) as error:
        length_report.read_run(workdir)
    truncated = tmp_path / "eval" / "test-4.json"
    assert str(error.value).startswith(f"{truncated} does not read (JSONDecodeError: ")
    assert "\n" not in str(error.value)


def test_runs_from_two_hosts_are_named_in_one_line_above_the_table(tmp_path, monkeypatch):
    runs = {}
    for name, cpu in (("rotary-0", "AMD EPYC"), ("rotary-1", "AMD EPYC"), ("rotary-2", "Intel Xeon")):
        (tmp_path / name).mkdir()
        workdir = _evaluated(tmp_path / name, monkeypatch, **{"test-6": _by_length(30.0)})
        record = {**provenance.collect(), "cpu": {"model": cpu, "cores": 2}}
        provenance.record_start(workdir, record)
        runs[name] = length_report.read_run(workdir)
        assert runs[name]["provenance"]["first"] == record
    markdown = length_report.write_report(runs, length_report.summarize(list(runs.values())),
                                          str(tmp_path / "report"))
    first_line = markdown.splitlines()[0]
    assert first_line.startswith("**Provenance:** These results come from 2 host kinds (AMD EPYC, 2 cores: "
                                 "rotary-0, rotary-1; Intel Xeon, 2 cores: rotary-2)")
    written = json.loads((tmp_path / "report" / "report.json").read_text())
    assert written["provenance"] == first_line.removeprefix("**Provenance:** ")
    same = {name: runs[name] for name in ("rotary-0", "rotary-1")}
    markdown = length_report.write_report(same, length_report.summarize(list(same.values())),
                                          str(tmp_path / "report"))
    assert "Provenance" not in markdown
