"""Tests for transformer_jax.evaluation.length_report: the seeds of each scheme summarized per bucket."""

import pytest

from transformer_jax.evaluation import length_report
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
    with pytest.raises(UserError, match="other length buckets"):
        length_report.summarize([_run("rotary", 0, [1.0, 2.0, 3.0]), other])
