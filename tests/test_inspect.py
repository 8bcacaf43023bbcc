"""Tests for transformer_jax.inspect / inspect_lib: maps, HTML, head statistics, the paper's experiments.

One tiny workdir is trained per module (a few steps: these are structure tests, not quality tests) and
the CLI is run on it once with small settings; the other tests read what it wrote.
"""

import json
import math
import struct

import numpy as np
import pytest
from tiny import config_with

from transformer_jax import inspect as inspect_cli
from transformer_jax import inspect_lib, train_lib
from transformer_jax.data import synthetic
from transformer_jax.model import sinusoidal_table

SENTENCE = "The old dog saw a red car."
# Distinct layer counts and an odd head count, so a kind/layer/head mix-up changes the image count.
ENC_LAYERS, DEC_LAYERS, HEADS = 2, 1, 3
TINY = {
    "data.synthetic_train_size": 300, "data.synthetic_dev_size": 11, "data.synthetic_test_size": 5,
    "data.vocab_size": 120, "data.tokens_per_batch": 448, "data.length_buckets": (64,),
    "model.d_model": 18, "model.d_ff": 22, "model.num_heads": HEADS,
    "model.num_encoder_layers": ENC_LAYERS, "model.num_decoder_layers": DEC_LAYERS,
    "train.num_steps": 3, "train.warmup_steps": 2,
    "log_every_steps": 3, "eval_every_steps": 0, "checkpoint_every_steps": 3,
    "checkpoint_every_minutes": 0.0, "final_eval_split": "",
}


def _tiny_config():
    return config_with(TINY)


@pytest.fixture(scope="module")
def inspected(tmp_path_factory):
    """Trains a tiny workdir, runs ``python -m transformer_jax.inspect`` on it in-process; returns paths."""
    workdir = tmp_path_factory.mktemp("inspect_workdir")
    train_lib.train_and_evaluate(_tiny_config(), str(workdir))
    out = workdir / "inspect_out"
    inspect_cli.main(["--workdir", str(workdir), "--sentence", SENTENCE, "--out", str(out),
                      "--num_dev", "11", "--d_ks", "4,64", "--lengths", "16,48", "--block_size", "16",
                      "--repeats", "1", "--max_extra_len", "3"])
    results = json.loads((out / "results.json").read_text())
    manifest = json.loads((out / "maps" / "manifest.json").read_text())
    return out, results, manifest


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_every_layer_and_head_has_a_plausible_png(inspected):
    out, results, manifest = inspected
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


def test_map_data_matches_the_plotted_pieces(inspected):
    out, _, manifest = inspected
    data = np.load(out / "maps" / "attention_maps.npz")
    src, outp, dec_in = (list(data[k]) for k in ("source_pieces", "output_pieces", "decoder_input_pieces"))
    assert src[-1] == "</s>" and dec_in[0] == "<s>" and dec_in[1:] == outp[:-1]
    shapes = {"encoder_self": (ENC_LAYERS, HEADS, len(src), len(src)),
              "decoder_self": (DEC_LAYERS, HEADS, len(outp), len(outp)),
              "cross": (DEC_LAYERS, HEADS, len(outp), len(src))}
    for kind, shape in shapes.items():
        assert data[kind].shape == shape, kind
    assert manifest["output"] is not None


def test_decoder_self_attention_is_exactly_zero_above_the_diagonal(inspected):
    out, _, _ = inspected
    maps = np.load(out / "maps" / "attention_maps.npz")["decoder_self"]  # [L, H, T, T]
    above = np.triu(np.ones(maps.shape[-2:], bool), k=1)
    assert above.any()
    assert np.all(maps[..., above] == 0.0)
    assert np.all(maps[..., ~above].sum(-1) > 0)


def test_every_row_of_every_map_sums_to_one(inspected):
    out, _, _ = inspected
    data = np.load(out / "maps" / "attention_maps.npz")
    for kind in inspect_lib.KINDS:
        np.testing.assert_allclose(data[kind].sum(-1), 1.0, atol=1e-5, err_msg=kind)
        assert np.all(data[kind] >= 0.0)


def test_html_references_every_image_and_table_and_needs_no_network(inspected):
    out, results, manifest = inspected
    page = (out / "index.html").read_text()
    for m in manifest["images"]:
        assert f'"maps/{m["image"]}"' in page, m["image"]
    for rel in results["files"].values():
        assert f'"{rel}"' in page, rel
        assert (out / rel).is_file(), rel
    assert "<select" in page and "<script>" in page
    assert "http://" not in page and "https://" not in page and "<script src" not in page


def test_head_statistics_are_in_range(inspected):
    _, results, _ = inspected
    rows = results["head_stats"]
    assert len(rows) == (ENC_LAYERS + 2 * DEC_LAYERS) * HEADS
    longest = max(r["uniform_entropy"] for r in rows)
    assert longest <= math.log(results["dev_max_len"]) + 1e-9
    for r in rows:
        assert r["rows"] > 0
        assert -1e-9 <= r["entropy"] <= r["uniform_entropy"] + 1e-6, r
        assert 0.0 <= r["max_weight"] <= 1.0 + 1e-6, r
        shares = [r[k] for k in ("prev", "self", "next") if not math.isnan(r[k])]
        assert all(0.0 <= s <= 1.0 + 1e-6 for s in shares), r
        expected_defined = {"encoder_self": 3, "decoder_self": 2, "cross": 0}[r["kind"]]
        assert len(shares) == expected_defined, r
        assert math.isfinite(r["delta_nll"])


def test_head_statistics_match_a_per_row_loop_and_catch_a_planted_previous_token_head():
    rng = np.random.default_rng(3)
    batch, heads, length = 3, 5, 7
    tokens = np.array([[5, 6, 7, 8, 9, 0, 0], [5, 6, 7, 8, 9, 10, 11], [5, 6, 0, 0, 0, 0, 0]])
    mask = inspect_lib.attention_mask("encoder_self", tokens, tokens)  # [B, 1, L, L]
    logits = rng.normal(size=(batch, heads, length, length)) * 2
    weights = np.where(mask, np.exp(logits), 0.0)
    weights = weights / np.maximum(weights.sum(-1, keepdims=True), 1e-30)
    prev_head = np.zeros((length, length))
    prev_head[np.arange(1, length), np.arange(length - 1)] = 1.0
    prev_head[0, 0] = 1.0
    weights[:, 2] = np.where(mask[:, 0], prev_head, 0.0)  # head 2: always the previous position
    stats = inspect_lib.HeadStatistics("encoder_self", heads)
    stats.add(weights, mask)
    means = stats.means()
    for h in range(heads):  # a plain loop over real rows
        ent, prev, prev_n, nxt, nxt_n, n = 0.0, 0.0, 0, 0.0, 0, 0
        for b in range(batch):
            real = int((tokens[b] != 0).sum())
            for q in range(real):
                w = weights[b, h, q, :real]
                ent += -sum(x * math.log(x) for x in w if x > 0)
                n += 1
                if q >= 1:
                    prev, prev_n = prev + w[q - 1], prev_n + 1
                if q + 1 < real:
                    nxt, nxt_n = nxt + w[q + 1], nxt_n + 1
        np.testing.assert_allclose(means["entropy"][h], ent / n, rtol=1e-9)
        np.testing.assert_allclose(means["prev"][h], prev / prev_n, rtol=1e-9)
        np.testing.assert_allclose(means["next"][h], nxt / nxt_n, rtol=1e-9)
    assert means["prev"][2] == 1.0 and means["entropy"][2] == 0.0 and means["next"][2] == 0.0
    assert means["rows"][0] == 5 + 7 + 2


def test_entropy_by_hand():
    w = np.array([[0.665241, 0.244728, 0.090031], [1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    np.testing.assert_allclose(inspect_lib.entropy(w), [0.832396, 0.0, math.log(3)], atol=1e-5)


def test_numpy_weights_reproduce_the_sown_weights_and_scaling_sharpens(inspected):
    _, results, _ = inspected
    for r in results["scaling_model"]:
        assert r["sown_vs_recomputed"] < 1e-4, r  # float32 model vs float64 NumPy, near one-hot rows
        assert r["entropy_unscaled"] <= r["entropy_scaled"] + 1e-6, r


def test_random_scaling_experiment():
    rows = inspect_lib.scaling_random((4, 64, 512), num_keys=33, num_queries=65)
    unscaled = [r["entropy_unscaled"] for r in rows]
    scaled = [r["entropy_scaled"] for r in rows]
    assert unscaled[0] > unscaled[1] > unscaled[2] and unscaled[2] < 0.5  # saturates as d_k grows
    assert max(scaled) - min(scaled) < 0.3 and min(scaled) > 0.7 * math.log(33)  # stays put
    np.testing.assert_allclose([r["logit_std_unscaled"] for r in rows], np.sqrt([4, 64, 512]), rtol=0.2)


def test_pe_linear_offset_check_passes_on_the_real_table_and_fails_when_corrupted():
    table = sinusoidal_table(97, 26)
    for k in (1, 2, 5, 31, 95):
        assert inspect_lib.pe_linear_offset_error(table, k) < 1e-6, k
        analytic = inspect_lib.pe_rotation(26, k)  # the paper's rotation, built from the formula
        np.testing.assert_allclose(table[:-k].astype(np.float64) @ analytic.T, table[k:], atol=1e-6)
    spike = table.copy()
    spike[40, 7] += 1e-3  # one entry off
    assert inspect_lib.pe_linear_offset_error(spike, 3) > 1e-4
    shuffled = table.copy()
    shuffled[:, [2, 5]] = shuffled[:, [5, 2]]  # a sin column moved into another frequency's pair
    assert inspect_lib.pe_linear_offset_error(shuffled, 1) > 1e-2
    noisy_positions = table + 1e-3 * np.random.default_rng(0).standard_normal(table.shape)
    assert inspect_lib.pe_linear_offset_error(noisy_positions, 10) > 1e-3
    with pytest.raises(ValueError, match="even d_model"):
        inspect_lib.pe_linear_offset_error(table[:, :25], 1)


def test_positions_and_complexity_results(inspected):
    _, results, _ = inspected
    assert results["positions"]["max_fit_error"] < 1e-6
    assert results["positions"]["max_analytic_error"] < 1e-6
    dense = {r["n"]: r for r in results["complexity"] if r["impl"] == "dense"}
    assert set(dense) == {16, 48}
    for r in dense.values():  # XLA counts the matmuls (plus the softmax's few per-entry FLOPs)
        analytic = r["flops_attention"] + r["flops_projections"]
        assert analytic <= r["flops_xla"] <= 1.5 * analytic, r
        assert r["seconds"] > 0
    # Table 1 as numbers: FLOPs = a n^2 d + b n d^2 with a = 4 (Q K^T, weights V) plus the softmax's few
    # FLOPs per weight (h of them per n^2 d), and b = 8 (W^Q, W^K, W^V, W^O).
    a, b, _ = inspect_lib.fit_cost_model(list(dense.values()))
    d_model = TINY["model.d_model"]
    assert 4.0 <= a <= 4.0 + 8 * HEADS / d_model, a
    assert 8.0 <= b <= 8.0 + 2 / d_model, b


def test_ablated_params_zero_exactly_one_head():
    import jax

    rng = np.random.default_rng(0)
    out = {"out": rng.normal(size=(3, 5, 7)).astype(np.float32),  # [h, d_v, d_model]
           "query": rng.normal(size=(7, 3, 5)).astype(np.float32)}
    params = {"encoder": {"layer_0": {"self_attention": dict(out)}},
              "decoder": {f"layer_{i}": {"self_attention": dict(out), "cross_attention": dict(out)}
                          for i in range(2)}}
    ablated = inspect_lib.ablated_params(params, "cross", 1, 2)
    kernel = np.asarray(ablated["decoder"]["layer_1"]["cross_attention"]["out"])
    assert np.all(kernel[2] == 0) and np.array_equal(kernel[:2], out["out"][:2])
    changed = [not np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ablated), strict=True)]
    assert sum(changed) == 1
    assert np.array_equal(params["decoder"]["layer_1"]["cross_attention"]["out"], out["out"])  # no mutation


def test_ablation_results_and_the_plain_statement(inspected):
    out, results, _ = inspected
    assert results["ablation_baseline"]["nll"] > 0
    summary = (out / "summary.md").read_text()
    assert "mixing coefficient, not an explanation" in summary
    assert "mixing coefficient, not an explanation" in (out / "index.html").read_text()


def test_synthetic_alignment_follows_the_grammar():
    lex = synthetic.build_lexicon(0)
    suffix = synthetic.AGREEMENT["nom"]["sg"][lex.noun_gender["dog"]]
    target = (f"{lex.stem['the'] + suffix} {lex.noun_stem['dog']} {lex.stem['big'] + suffix} "
              f"{lex.stem['sleep'] + synthetic.VERB_SUFFIX['pres']['3s']}.").capitalize()
    pairs = inspect_lib.synthetic_word_alignment("The big dog sleeps.", target, 0)
    assert pairs == [(0, 0), (1, 2), (2, 1), (3, 3)]  # the adjective follows its noun
    assert inspect_lib._crossing(pairs) == {2}
    assert inspect_lib.word_of_piece(["\u2581Th", "e", "\u2581big", ".", "</s>"]) == [0, 0, 1, 1, -1]


def test_alignment_masses_are_shares(inspected):
    _, results, _ = inspected
    rows = results["alignment"]
    assert len(rows) == DEC_LAYERS * HEADS
    for r in rows:
        assert r["words"] > 0 and 0.0 < r["chance_all"] < 1.0, r
        for key in ("mass_all", "mass_first"):
            assert 0.0 <= r[key] <= 1.0 + 1e-6, r
