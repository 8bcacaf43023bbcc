"""End to end: ``python -m transformer_jax.inspect`` on a tiny trained workdir, and what it writes.

The CLI is run once, in a subprocess as a user runs it, with small settings, on the shared tiny trained
workdir (``tiny.TRAINED``: a few steps, as these are structure tests, not quality tests); the other tests
read what it wrote. The unit tests of each analysis are in tests/test_inspect_<module>.py.
"""

import json
import math
import os
import re
import struct
import subprocess
import sys
import types

import numpy as np
import pytest
from tiny import TRAINED

from transformer_jax.evaluation import translation
from transformer_jax.inspect import ablation, complexity, forward, run_all
from transformer_jax.model.special_ids import EOS_ID, PAD_ID

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SENTENCE = "The old dog saw a red car."
# The shared run's distinct layer counts and odd head count: a kind/layer/head mix-up changes the image count.
ENC_LAYERS, DEC_LAYERS, HEADS, D_MODEL = (TRAINED[f"model.{k}"] for k in (
    "num_encoder_layers", "num_decoder_layers", "num_heads", "d_model"))
FLAGS = ("workdir", "sentence", "out", "step", "num_dev", "d_ks", "lengths", "block_size", "repeats",
         "max_extra_len", "skip_ablation", "skip_benchmark")


def _cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "transformer_jax.inspect", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def inspected(trained_run, tmp_path_factory):
    """Runs ``python -m transformer_jax.inspect`` on the shared trained workdir; returns what it wrote."""
    assert ENC_LAYERS != DEC_LAYERS and HEADS % 2 == 1  # else a mix-up could keep the counts
    out = tmp_path_factory.mktemp("inspect") / "out"
    proc = _cli("--workdir", trained_run[0], "--sentence", SENTENCE, "--out", str(out), "--num_dev", "11",
                "--d_ks", "4,64", "--lengths", "16,48", "--block_size", "16", "--repeats", "1",
                "--max_extra_len", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    manifest = json.loads((out / "maps" / "manifest.json").read_text())
    return out, results, manifest, proc.stdout


def test_help_explains_every_flag():
    proc = _cli("--help", timeout=120)
    text = proc.stdout
    for name in FLAGS:
        match = re.search(rf"--(?:\[no\])?{name}: (\S.*)", text)
        assert match and len(match.group(1)) > 15, (name, text)


def test_bad_flag_values_fail_before_any_work(tmp_path):
    proc = _cli("--workdir", str(tmp_path), "--sentence", "x", "--d_ks", "4,x", timeout=120)
    assert proc.returncode != 0 and "--d_ks must be comma-separated positive integers" in proc.stderr
    proc = _cli("--sentence", "x", timeout=120)
    assert proc.returncode != 0 and "workdir" in proc.stderr


def test_cli_prints_the_summary_and_the_page(inspected):
    out, _, _, stdout = inspected
    assert (out / "summary.md").read_text().strip() in stdout
    assert f"{out}/index.html" in stdout


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_every_layer_and_head_has_a_plausible_png(inspected):
    out, results, manifest, _ = inspected
    expected = {(kind, layer, head) for kind, layers in
                (("encoder_self", ENC_LAYERS), ("decoder_self", DEC_LAYERS), ("cross", DEC_LAYERS))
                for layer in range(layers) for head in range(HEADS)}
    assert {(m["kind"], m["layer"], m["head"]) for m in manifest["images"]} == expected
    analysis_pngs = [results["files"][k] for k in results["files"] if k.endswith("_png")]
    assert len(analysis_pngs) == 5  # head stats, scaling, positions, complexity, ablation
    for rel in ["maps/" + m["image"] for m in manifest["images"]] + analysis_pngs:
        path = out / rel
        assert path.stat().st_size > 5_000, rel
        width, height = _png_size(path)
        assert 200 <= width <= 6000 and 150 <= height <= 6000, (rel, width, height)


def test_output_file_names_are_stable(inspected):
    out, results, _, _ = inspected
    names = {"index.html", "summary.md", "results.json", "head_stats.csv", "head_stats.md", "head_stats.png",
             "scaling_random.csv", "scaling_model.csv", "scaling.png", "positions_offset.csv",
             "positions.png", "complexity.csv", "complexity.png", "ablation.csv", "ablation.png",
             "alignment.csv", "maps/attention_maps.npz", "maps/manifest.json"}
    for name in names:
        assert (out / name).is_file(), name
    assert set(results["files"].values()) <= names


def test_map_data_matches_the_plotted_pieces(inspected):
    out, results, manifest, _ = inspected
    data = np.load(out / "maps" / "attention_maps.npz")
    src, outp, dec_in = (list(data[k]) for k in ("source_pieces", "output_pieces", "decoder_input_pieces"))
    assert src[-1] == "</s>" and dec_in[0] == "<s>" and dec_in[1:] == outp[:-1]
    assert len(outp) <= len(src) + 3  # --max_extra_len 3
    shapes = {"encoder_self": (ENC_LAYERS, HEADS, len(src), len(src)),
              "decoder_self": (DEC_LAYERS, HEADS, len(outp), len(outp)),
              "cross": (DEC_LAYERS, HEADS, len(outp), len(src))}
    for kind, shape in shapes.items():
        assert data[kind].shape == shape, kind
    assert manifest["source"] == SENTENCE and manifest["output"] == results["output"]


def test_decoder_self_attention_is_exactly_zero_above_the_diagonal(inspected):
    out, _, _, _ = inspected
    maps = np.load(out / "maps" / "attention_maps.npz")["decoder_self"]  # [L, H, T, T]
    above = np.triu(np.ones(maps.shape[-2:], bool), k=1)
    assert above.any()
    assert np.all(maps[..., above] == 0.0)
    assert np.all(maps[..., ~above].sum(-1) > 0)


def test_every_row_of_every_map_sums_to_one(inspected):
    out, _, _, _ = inspected
    data = np.load(out / "maps" / "attention_maps.npz")
    for kind in forward.KINDS:
        np.testing.assert_allclose(data[kind].sum(-1), 1.0, atol=1e-5, err_msg=kind)
        assert np.all(data[kind] >= 0.0)


def test_html_references_every_image_and_table_and_needs_no_network(inspected):
    out, results, manifest, _ = inspected
    page = (out / "index.html").read_text()
    for m in manifest["images"]:
        assert f'"maps/{m["image"]}"' in page, m["image"]
    for rel in results["files"].values():
        assert f'"{rel}"' in page, rel
        assert (out / rel).is_file(), rel
    assert page.count("<select") == 3 and "<script>" in page
    assert f"const HEADS = {HEADS};" in page
    assert json.dumps({"encoder_self": ENC_LAYERS, "decoder_self": DEC_LAYERS, "cross": DEC_LAYERS}) in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page


def test_head_statistics_are_in_range(inspected):
    _, results, _, _ = inspected
    rows = results["head_stats"]
    assert len(rows) == (ENC_LAYERS + 2 * DEC_LAYERS) * HEADS
    longest = max(r["uniform_entropy"] for r in rows)
    assert longest <= math.log(results["dev_max_len"]) + 1e-9
    assert results["num_dev_sentences"] == 11
    for r in rows:
        assert r["rows"] > 0
        assert -1e-9 <= r["entropy"] <= r["uniform_entropy"] + 1e-6, r
        assert 0.0 <= r["max_weight"] <= 1.0 + 1e-6, r
        shares = [r[k] for k in ("prev", "self", "next") if not math.isnan(r[k])]
        assert all(0.0 <= s <= 1.0 + 1e-6 for s in shares), r
        expected_defined = {"encoder_self": 3, "decoder_self": 2, "cross": 0}[r["kind"]]
        assert len(shares) == expected_defined, r
        assert math.isfinite(r["delta_nll"])


def test_numpy_weights_reproduce_the_sown_weights_and_scaling_sharpens(inspected):
    _, results, _, _ = inspected
    assert [(r["kind"], r["layer"]) for r in results["scaling_model"]] == (
        [("encoder_self", i) for i in range(ENC_LAYERS)] + [("decoder_self", i) for i in range(DEC_LAYERS)]
        + [("cross", i) for i in range(DEC_LAYERS)])
    for r in results["scaling_model"]:
        assert r["sown_vs_recomputed"] < 1e-4, r  # float32 model vs float64 NumPy, near one-hot rows
        assert r["entropy_unscaled"] <= r["entropy_scaled"] + 1e-6, r
        assert r["d_k"] == D_MODEL // HEADS
    assert [r["d_k"] for r in results["scaling_random"]] == [4, 64]


def test_positions_and_complexity_results(inspected):
    _, results, _, _ = inspected
    assert results["positions"]["max_fit_error"] < 1e-6
    assert results["positions"]["max_analytic_error"] < 1e-6
    dense = {r["n"]: r for r in results["complexity"] if r["impl"] == "dense"}
    assert set(dense) == {16, 48}
    assert {r["n"] for r in results["complexity"] if r["impl"] == "blockwise"} == {16, 48}
    for r in dense.values():  # XLA counts the matmuls (plus the softmax's few per-entry FLOPs)
        analytic = r["flops_attention"] + r["flops_projections"]
        assert analytic <= r["flops_xla"] <= 1.5 * analytic, r
        assert r["seconds"] > 0
    # Table 1 as numbers: FLOPs = a n^2 d + b n d^2 with a = 4 (Q K^T, weights V) plus the softmax's few
    # FLOPs per weight (h of them per n^2 d), and b = 8 (W^Q, W^K, W^V, W^O).
    a, b, _ = complexity.fit_cost_model(list(dense.values()))
    assert 4.0 <= a <= 4.0 + 8 * HEADS / D_MODEL, a
    assert 8.0 <= b <= 8.0 + 2 / D_MODEL, b


def test_ablation_results(inspected):
    out, results, _, _ = inspected
    base = results["ablation_baseline"]
    assert base["nll"] > 0 and 0.0 <= base["accuracy"] <= 1.0
    lines = (out / "ablation.csv").read_text().splitlines()
    assert len(lines) == 1 + 1 + (ENC_LAYERS + 2 * DEC_LAYERS) * HEADS  # header, baseline, every head
    assert any(abs(r["delta_nll"]) > 0 for r in results["head_stats"])  # zeroing a head changes the loss


def test_alignment_masses_are_shares(inspected):
    _, results, _, _ = inspected
    rows = results["alignment"]
    assert [(r["layer"], r["head"]) for r in rows] == [(0, h) for h in range(HEADS)]
    for r in rows:
        assert r["words"] > 0 and 0.0 < r["chance_all"] < 1.0, r
        assert r["reordered_words"] <= r["words"]
        for key in ("mass_all", "mass_first"):
            assert 0.0 <= r[key] <= 1.0 + 1e-6, r


def _numbers(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+(?:e[-+]?\d+)?", text)]


def test_summary_reports_the_results_numbers(inspected):
    out, results, _, _ = inspected
    summary = (out / "summary.md").read_text().strip()
    sections = re.findall(r"^## (.+)$", summary, re.M)
    assert [s.split(" ")[0] for s in sections] == ["Heads", "Ablation", "Scaling", "Positions", "Table"]
    base = results["ablation_baseline"]
    ablation_part = summary.split("## Ablation")[1].split("## Scaling")[0]
    assert round(base["nll"], 4) in _numbers(ablation_part) and round(base["accuracy"], 4) in _numbers(
        ablation_part)
    worst = max(results["head_stats"], key=lambda r: r["delta_nll"])
    assert f"{worst['kind']} L{worst['layer']}H{worst['head']} +{worst['delta_nll']:.4f}" in ablation_part
    for r in results["scaling_model"]:  # one line per (kind, layer) with both entropies
        line = next(x for x in summary.splitlines() if x.startswith(f"- Model {r['kind']} L{r['layer']} "))
        assert [round(r["entropy_scaled"], 2), round(r["entropy_unscaled"], 2)] == _numbers(line)[:2]
    assert results["summary"] == summary


def test_summary_leaves_out_what_was_not_run(inspected):
    _, results, _, _ = inspected
    cfg = types.SimpleNamespace(d_model=D_MODEL)
    trimmed = dict(results, ablation_baseline=None, complexity=[], alignment=[])
    sections = re.findall(r"^## (.+)$", run_all.summarize(trimmed, cfg), re.M)
    assert [s.split(" ")[0] for s in sections] == ["Heads", "Scaling", "Positions"]
    assert ablation.WEIGHTS_ARE_NOT_EXPLANATIONS not in run_all.summarize(trimmed, cfg)


def test_a_sentence_longer_than_the_model_reads_is_one_error_line(trained_run, tmp_path):
    proc = _cli("--workdir", trained_run[0], "--sentence", " ".join(["dog"] * 500), "--out",
                str(tmp_path / "long_out"), timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[-2].startswith("error: --sentence is ")
    assert "(500 words); the model reads at most" in lines[-2]
    assert lines[-1].startswith("(set TRANSFORMER_JAX_TRACEBACK=1")


def test_a_long_sentence_decodes_within_the_model_limit(trained_run):
    restored = forward.restore_workdir(trained_run[0])
    max_len = restored.model_config.max_len
    words = []
    while len(restored.tokenizer.encode(" ".join(words + ["dog"]))) + 1 <= max_len - 2:
        words.append("dog")
    inputs = forward.encode_sentence(restored.tokenizer, " ".join(words), max_len)
    assert max_len - 3 <= inputs.shape[1] <= max_len - 2  # + max_extra_len=50 would not fit
    output = forward.greedy_output(restored.params, restored.model_config, inputs, max_extra_len=50)
    # The translate path's greedy search with the allowance that fits (max_len - source length): the same
    # tokens, up to and including EOS.
    [reference] = translation.decode_ids(
        restored.params, restored.model_config, [inputs[0]],
        translation.Settings(beam_size=1, max_extra_len=max_len - inputs.shape[1]))
    reference = reference[reference != PAD_ID]
    if EOS_ID in reference:
        reference = reference[:list(reference).index(EOS_ID) + 1]
    np.testing.assert_array_equal(output[0], reference)
    assert 1 <= output.shape[1] <= max_len


def test_a_model_with_relative_positions_is_inspected_with_its_own_terms(tmp_path):
    """An untrained workdir of relative positions (a logit term, an output term, tables per layer): the
    scaling experiment's recomputed maps are the model's own (the relative key term added), and the
    positions section analyses its tables."""
    from tiny import TRAIN, config_with, untrained_workdir

    config = config_with({**TRAIN, "model.position_encoding": "relative", "model.max_relative_position": 3})
    workdir = str(tmp_path / "run")
    untrained_workdir(config, workdir)
    options = run_all.InspectOptions(num_dev=5, d_ks=(4, 64), max_extra_len=3, ablation=False,
                                     benchmark=False, alignment=False)
    results = run_all.run(workdir, SENTENCE, str(tmp_path / "out"), options=options)
    assert max(r["sown_vs_recomputed"] for r in results["scaling_model"]) < 1e-4
    layers = results["positions"]["layers"]
    assert [(la["stack"], la["layer"]) for la in layers] == [
        ("encoder", i) for i in range(ENC_LAYERS)] + [("decoder", i) for i in range(DEC_LAYERS)]
    summary = results["summary"]
    assert "distances -3..3" in summary and "adds the relative key term" in summary
    assert results["files"]["positions_csv"] == "positions_relative.csv"
    assert "positions.png" in (tmp_path / "out" / "index.html").read_text()
