"""Runs every analysis on a workdir into one folder: ``index.html``, ``summary.md``, ``results.json``, data.

See the package docstring for what each file holds; ``docs/inspect.md`` for how each analysis is done.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

from transformer_jax.evaluation import paper
from transformer_jax.inspect import (
    ablation,
    alignment,
    artifacts,
    complexity,
    dev,
    forward,
    heads,
    maps,
    page,
    positions,
    scaling,
)
from transformer_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class InspectOptions:
    """What :func:`run` computes. Small values make it a quick smoke run (tests)."""

    num_dev: int = 200  # dev sentences for head statistics, the scaling experiment and the ablation
    d_ks: tuple[int, ...] = scaling.DEFAULT_D_KS  # random-q/k scaling experiment
    lengths: tuple[int, ...] = complexity.DEFAULT_LENGTHS  # self-attention cost against n
    block_size: int = 128  # blockwise attention tile in the cost experiment
    repeats: int = 3  # timing repeats (median)
    max_extra_len: int = paper.MAX_EXTRA_LEN  # greedy decoding limit: input length + this
    ablation: bool = True
    benchmark: bool = True
    alignment: bool = True  # synthetic task only


def run(workdir: str, sentence: str, out_dir: str | None = None, *, step: int | None = None,
        options: InspectOptions = InspectOptions()) -> dict[str, Any]:
    """Restores ``workdir`` and writes every analysis into ``out_dir`` (default ``workdir/inspect``).

    Returns:
      A dict of the results (also saved as ``results.json``) with the markdown summary under "summary".
    """
    out_dir = out_dir or os.path.join(workdir, "inspect")
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[inspect {time.perf_counter() - start:5.1f}s] {message}", file=sys.stderr, flush=True)

    def table(rows, name: str, digits: int = 3) -> str:
        return artifacts.write_table(rows, os.path.join(out_dir, name), digits=digits)[0]

    restored = forward.restore_workdir(workdir, step)  # a missing workdir fails before anything is made
    os.makedirs(os.path.join(out_dir, "maps"), exist_ok=True)
    progress(f"restored step {restored.step} of {workdir}; attention maps")
    cfg = restored.model_config
    files: dict[str, str] = {}

    sm = maps.sentence_maps(restored, sentence, max_extra_len=options.max_extra_len)
    manifest = maps.write_sentence_maps(sm, os.path.join(out_dir, "maps"))

    progress(f"head statistics over {options.num_dev} dev sentences")
    batches = forward.dev_batches(restored, options.num_dev)
    analysis = dev.analyse_dev(restored, batches)
    if options.ablation:
        progress("ablating one head at a time")
    ablated = ablation.ablate_heads(restored, batches) if options.ablation else None
    stat_rows = heads.head_stats_rows(analysis.stats, ablated)
    files["head_stats_csv"], files["head_stats_md"] = artifacts.write_table(
        stat_rows, os.path.join(out_dir, "head_stats"))
    files["head_stats_png"] = heads.plot_head_stats(stat_rows, os.path.join(out_dir, "head_stats.png"))

    progress("scaling and position experiments")
    random_rows = scaling.scaling_random(options.d_ks)
    model_rows = scaling.scaling_model_rows(analysis.scaling, analysis.stats, cfg.d_k, dtype=cfg.dtype)
    files["scaling_random_csv"] = table(random_rows, "scaling_random", 4)
    files["scaling_model_csv"] = table(model_rows, "scaling_model", 4)
    files["scaling_png"] = scaling.plot_scaling(random_rows, model_rows, os.path.join(out_dir, "scaling.png"))

    positions_results, positions_files = positions_section(cfg, restored.params, out_dir)
    files.update(positions_files)

    cost_rows = []
    if options.benchmark:
        progress(f"cost of one self-attention layer at n = {', '.join(map(str, options.lengths))}")
        for impl in ("dense", "blockwise"):
            cost_rows += complexity.self_attention_cost(
                options.lengths, d_model=cfg.d_model, num_heads=cfg.num_heads, impl=impl,
                block_size=options.block_size, repeats=options.repeats)
        files["complexity_csv"] = table(cost_rows, "complexity", 6)
        files["complexity_png"] = complexity.plot_complexity(cost_rows,
                                                             os.path.join(out_dir, "complexity.png"))

    if ablated is not None:
        ablation_rows = [{"kind": k, "layer": la, "head": h, **v} for (k, la, h), v in ablated.items()]
        files["ablation_csv"] = table(ablation_rows, "ablation", 4)
        files["ablation_png"] = ablation.plot_ablation(stat_rows, os.path.join(out_dir, "ablation.png"))

    align_rows = []
    if options.alignment and restored.run.data.source == "synthetic":
        progress("cross-attention against the synthetic grammar's alignment")
        align_rows = alignment.alignment_analysis(restored, batches)
        if align_rows:
            files["alignment_csv"] = table(align_rows, "alignment")

    results = {
        "workdir": workdir, "out_dir": out_dir, "step": restored.step, "sentence": sentence,
        "output": sm.output,
        "num_dev_sentences": analysis.num_sentences,
        "dev_max_len": max(max(b.inputs.shape[1], b.targets.shape[1]) for b in batches),
        "head_stats": stat_rows,
        "scaling_random": random_rows, "scaling_model": model_rows,
        "positions": positions_results,
        "complexity": cost_rows, "alignment": align_rows,
        "ablation_baseline": None if ablated is None else ablated[ablation.BASELINE],
        "files": {k: os.path.relpath(v, out_dir) for k, v in files.items()},
    }
    results["summary"] = summarize(results, cfg)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(results["summary"] + "\n")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=float)
    page.write_html(os.path.join(out_dir, "index.html"), results, manifest, sm, cfg)
    return results


def positions_section(cfg: Any, params: Any, out_dir: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The positions analysis of the scheme the model has (``positions.model_positions_report``), written
    into ``out_dir``: (its results, {file key: path}); without positions (``none``), {"applies": False}
    and no files."""
    report = positions.model_positions_report(cfg, params)
    if report is None:
        return {"applies": False, "position_encoding": cfg.position_encoding}, {}
    kind, rows = report["kind"], report["rows"]
    files = {"positions_png": positions.plot_positions(report, os.path.join(out_dir, "positions.png"))}
    results: dict[str, Any] = {"applies": True, "position_encoding": kind}
    if kind in ("sinusoidal", "learned"):
        results.update(offsets=[rows[0]["k"], rows[-1]["k"]],
                       **{f"max_{key}": max(r[key] for r in rows) for key in rows[0] if key != "k"})
        stem = "positions_offset"
    elif kind == "rotary":
        wavelengths = [p["wavelength"] for p in report["pairs"]]
        results.update(d_k=report["d_k"], pairs=report["pairs"], shift=report["shift"],
                       shift_error=report["shift_error"],
                       num_offsets=len(rows), min_wavelength=min(wavelengths),
                       max_wavelength=max(wavelengths),
                       logits={o: {"ones": rows[o]["logit_ones"], "random": rows[o]["logit_random"]}
                               for o in positions.SHOWN_OFFSETS if o < len(rows)},
                       half_offset=next((r["offset"] for r in rows if r["logit_ones"] < 0.5), None))
        files["positions_pairs_csv"] = artifacts.write_table(
            report["pairs"], os.path.join(out_dir, "positions_rotary_pairs"), digits=6)[0]
        stem = "positions_rotary_offsets"
    elif kind == "alibi":
        results.update(offsets=report["offsets"], heads=rows)
        stem = "positions_alibi"
    else:  # relative
        results.update(k=report["k"], layers=[
            {key: value for key, value in layer.items() if key not in ("key_cosine", "value_cosine")}
            for layer in report["layers"]])
        stem = "positions_relative"
    files["positions_csv"] = artifacts.write_table(rows, os.path.join(out_dir, stem), digits=9)[0]
    return results, files


def positions_lines(p: dict[str, Any], cfg: Any) -> list[str]:
    """The summary's positions section for the results of ``positions_section``."""
    lines = ["", "## Positions", ""]
    if not p["applies"]:
        return lines + [f"- position_encoding={p['position_encoding']!r}: no position information; "
                        "the section does not apply."]
    kind = p["position_encoding"]
    if kind == "rotary":
        return lines + _rotary_lines(p)
    if kind == "alibi":
        return lines + _alibi_lines(p)
    if kind == "relative":
        return lines + _relative_lines(p)
    k0, k1 = p["offsets"]
    if kind == "learned":
        return lines + [
            f"- The model's learned position tables (Table 3 row E; d_model={cfg.d_model}): with the best "
            f"fitted block-diagonal M_k, max |PE(pos+k) - M_k PE(pos)| over k in {k0}..{k1} is "
            f"{p['max_fit_error']:.2e} (encoder) and {p['max_decoder_fit_error']:.2e} (decoder); a "
            "sinusoidal table gives float rounding, about 1e-7."]
    return lines + [
        f"- PE(pos+k) = M_k PE(pos) for every k in {k0}..{k1} "
        f"(d_model={cfg.d_model}): max error {p['max_fit_error']:.2e} with the fitted block-diagonal "
        f"M_k, {p['max_analytic_error']:.2e} with the analytic rotation; fitted vs analytic blocks "
        f"differ by at most {p['max_fit_vs_analytic']:.2e} (the lowest frequencies barely rotate "
        "over max_len positions, so the data pins their blocks down only loosely)."]


def _rotary_lines(p: dict[str, Any]) -> list[str]:
    d_k, n = p["d_k"], p["num_offsets"]
    slow = sum(pair["wavelength"] > n for pair in p["pairs"])
    half = (f"falls below 0.5 at offset {p['half_offset']}" if p["half_offset"] is not None
            else f"stays above 0.5 up to offset {n - 1}")
    return [
        f"- Rotary positions on queries and keys of every self-attention (d_k={d_k}, {d_k // 2} dimension "
        f"pairs (i, i + {d_k // 2}), rate 10000^(-2i/d_k) radians per token): wavelengths from "
        f"{p['min_wavelength']:.1f} to {p['max_wavelength']:.3g} tokens; {slow} of the {d_k // 2} pairs turn "
        f"less than once in {n} tokens.",
        f"- The logit of one query/key pair with q = k = ones / sqrt(d_k) (1 at offset 0) {half}; at offsets "
        + ", ".join(f"{o}: {v['ones']:.3f}" for o, v in p["logits"].items())
        + "; for a random unit q = k: "
        + ", ".join(f"{o}: {v['random']:.3f}" for o, v in p["logits"].items())
        + f". It depends on the offset alone (moved on by {p['shift']} positions: max change "
        f"{p['shift_error']:.1e}).",
        "- The scaling experiment reads the rotated q and k the model sows: its maps include the rotation."]


def _alibi_lines(p: dict[str, Any]) -> list[str]:
    offsets = p["offsets"]
    shown = [o for o in offsets if o in (1, 16, 256)] or offsets[:3]
    heads = "; ".join(f"h{r['head']} m={r['slope']:.4g} (" + ", ".join(
        f"{r[f'bias_{o}']:.3g} at {o}" for o in shown) + ")" for r in p["heads"])
    return [
        f"- ALiBi: each of {len(p['heads'])} heads adds -m_h |i - j| to its self-attention logits (encoder "
        "both ways, decoder the past; nothing in encoder-decoder attention). Slopes and bias: " + heads + ".",
        f"- A head's bias reaches -1 at 1/m_h tokens: from {min(r['reach'] for r in p['heads']):.3g} to "
        f"{max(r['reach'] for r in p['heads']):.3g}. The scaling experiment adds this bias to its maps."]


def _relative_lines(p: dict[str, Any]) -> list[str]:
    k = p["k"]
    lines = [f"- Relative positions (Shaw et al.): per self-attention layer, a^K and a^V rows for the "
             f"distances -{k}..{k} (clipped; the causal decoder reads only distances <= 0, its other rows "
             f"keep their initial values). Row norms at distance 0 and at the clip -{k}, the mean cosine "
             f"of neighbouring distances, and the cosine of the two clip rows -{k} and +{k}:"]
    for layer in p["layers"]:
        lines.append(
            f"  - {layer['stack']} L{layer['layer']}: |a^K| {layer['key_norm_0']:.3f} / "
            f"{layer['key_norm_clip']:.3f}, |a^V| {layer['value_norm_0']:.3f} / "
            f"{layer['value_norm_clip']:.3f}; "
            f"neighbours' cosine a^K {layer['key_neighbour_cosine']:.2f}, a^V "
            f"{layer['value_neighbour_cosine']:.2f}; a^K(-{k}) vs a^K(+{k}) {layer['key_ends_cosine']:.2f}.")
    lines.append("- The scaling experiment adds the relative key term q_i a^K_(j-i) to its maps.")
    return lines


def _top(rows, key, n=3, where=lambda r: True):
    sel = [r for r in rows if where(r) and not math.isnan(r[key])]
    return sorted(sel, key=lambda r: -r[key])[:n]


def _head_name(r) -> str:
    return f"{r['kind']} L{r['layer']}H{r['head']}"


def _heads_lines(results: dict[str, Any]) -> list[str]:
    stats = results["head_stats"]
    lines = ["## Heads", ""]
    for kind, offsets in (("encoder_self", ("prev", "self", "next")), ("decoder_self", ("prev", "self"))):
        for name in offsets:
            best = _top(stats, name, 2, lambda r, k=kind: r["kind"] == k)
            lines.append(f"- {forward.KIND_TITLES[kind]}, most '{name}'-position mass: " + ", ".join(
                f"{_head_name(r)} {r[name]:.2f}" for r in best))
    lines.append("- Sharpest heads (mean max weight): " + ", ".join(
        f"{_head_name(r)} {r['max_weight']:.2f} (entropy {r['entropy']:.2f} of {r['uniform_entropy']:.2f})"
        for r in _top(stats, "max_weight", 3)))
    if results["alignment"]:
        best = sorted(results["alignment"], key=lambda r: -r["mass_all"])[:3]
        first = sorted(results["alignment"], key=lambda r: -r["mass_first_reordered"])[:3]
        r0 = results["alignment"][0]
        lines.append(f"- Cross-attention mass on the grammar-aligned source word, every piece of "
                     f"{r0['words']} aligned words (uniform: {r0['chance_all']:.2f}): " + ", ".join(
                         f"L{r['layer']}H{r['head']} {r['mass_all']:.2f}" for r in best))
        lines.append(f"- The same for the stem (first piece) of the {r0['reordered_words']} reordered words "
                     f"(adjective after its noun, verb-final; uniform {r0['chance_first_reordered']:.2f}): "
                     + ", ".join(f"L{r['layer']}H{r['head']} {r['mass_first_reordered']:.2f}" for r in first))
    return lines


def _ablation_lines(results: dict[str, Any]) -> list[str]:
    stats, base = results["head_stats"], results["ablation_baseline"]
    worst = _top(stats, "delta_nll", 3)
    least = sorted(stats, key=lambda r: abs(r["delta_nll"]))[:3]
    rho = ablation.spearman([r["max_weight"] for r in stats], [r["delta_nll"] for r in stats])
    rho_h = ablation.spearman([-r["entropy"] for r in stats], [r["delta_nll"] for r in stats])
    return ["", "## Ablation (weights are not causal importance)", "", ablation.WEIGHTS_ARE_NOT_EXPLANATIONS,
            "", f"- Baseline dev NLL {base['nll']:.4f} nats/token, accuracy {base['accuracy']:.4f}.",
            "- Largest NLL increases: " + ", ".join(f"{_head_name(r)} +{r['delta_nll']:.4f}" for r in worst),
            "- Smallest |change|: " + ", ".join(f"{_head_name(r)} {r['delta_nll']:+.4f}" for r in least),
            f"- Spearman rank correlation of a head's mean max weight with its ablation effect: "
            f"{rho:.2f}; of its negative entropy: {rho_h:.2f}."]


def _scaling_and_positions_lines(results: dict[str, Any], cfg: ModelConfig) -> list[str]:
    rnd = results["scaling_random"]
    lines = ["", "## Scaling by 1/sqrt(d_k)", "",
             f"- Random unit-variance q, k over {math.exp(rnd[0]['uniform_entropy']):.0f} keys: entropy "
             f"scaled {rnd[0]['entropy_scaled']:.2f} -> {rnd[-1]['entropy_scaled']:.2f}, unscaled "
             f"{rnd[0]['entropy_unscaled']:.2f} -> {rnd[-1]['entropy_unscaled']:.2f} nats as d_k goes "
             f"{rnd[0]['d_k']} -> {rnd[-1]['d_k']} (uniform {rnd[0]['uniform_entropy']:.2f})."]
    for r in results["scaling_model"]:
        lines.append(f"- Model {r['kind']} L{r['layer']} (d_k={r['d_k']}): entropy "
                     f"{r['entropy_scaled']:.2f} as trained, {r['entropy_unscaled']:.2f} without the factor "
                     f"(uniform {r['uniform_entropy']:.2f}); std of raw q.k {r['logit_std_unscaled']:.1f}.")
    return lines + positions_lines(results["positions"], cfg)


def summarize(results: dict[str, Any], cfg: ModelConfig) -> str:
    """A short markdown summary of ``results`` (the numbers the report leads with)."""
    lines = [f"# Inspecting {results['workdir']} (step {results['step']})", "",
             f"- Sentence: `{results['sentence']}`", f"- Greedy output: `{results['output']}`",
             f"- Dev sentences analysed: {results['num_dev_sentences']}", ""]
    lines += _heads_lines(results)
    if results["ablation_baseline"] is not None:
        lines += _ablation_lines(results)
    lines += _scaling_and_positions_lines(results, cfg)
    if results["complexity"]:
        lines += ["", "## Table 1 measured (one self-attention layer, forward)", ""]
        lines += [complexity.summary_line(impl, [r for r in results["complexity"] if r["impl"] == impl])
                  for impl in ("dense", "blockwise")]
        lines.append(f"- Attention (4 n^2 d) overtakes the projections (8 n d^2) at n = 2 d = "
                     f"{2 * cfg.d_model}. XLA's cost analysis counts a loop body once, so the blockwise "
                     "FLOPs cover one tile, not the layer.")
    return "\n".join(lines)
