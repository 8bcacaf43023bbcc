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
    """The positions analysis of what the model has (``positions.model_positions_report``), written into
    ``out_dir``: (its results, {file key: path}); for a scheme it does not know, {"applies": False} and no
    files."""
    report = positions.model_positions_report(cfg, params)
    if report is None:
        return {"applies": False, "position_encoding": cfg.position_encoding}, {}
    rows = report["rows"]
    results = {"applies": True, "position_encoding": report["kind"], "offsets": [rows[0]["k"], rows[-1]["k"]],
               **{f"max_{key}": max(r[key] for r in rows) for key in rows[0] if key != "k"}}
    files = {"positions_csv": artifacts.write_table(rows, os.path.join(out_dir, "positions_offset"),
                                                    digits=9)[0],
             "positions_png": positions.plot_positions(report, os.path.join(out_dir, "positions.png"))}
    return results, files


def positions_lines(p: dict[str, Any], cfg: Any) -> list[str]:
    """The summary's positions section for the results of ``positions_section``."""
    lines = ["", "## Positions", ""]
    if not p["applies"]:
        return lines + [f"- This model's position_encoding={p['position_encoding']!r} is neither the paper's "
                        "sinusoid nor a learned table: the positions analysis does not apply."]
    k0, k1 = p["offsets"]
    if p["position_encoding"] == "learned":
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
