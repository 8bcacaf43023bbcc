"""The report's HTML page: one self-contained file (inline CSS and JS, relative links, no network)."""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from typing import Any

from transformer_jax.inspect import artifacts, forward
from transformer_jax.inspect.ablation import WEIGHTS_ARE_NOT_EXPLANATIONS
from transformer_jax.inspect.maps import SentenceMaps
from transformer_jax.model.config import ModelConfig

# (title, figure key, table key, results key of the rows shown inline or None) in ``results["files"]``.
_SECTIONS = (
    ("Head statistics", "head_stats_png", "head_stats_csv", "head_stats"),
    ("Scaling by 1/sqrt(d_k)", "scaling_png", "scaling_model_csv", "scaling_model"),
    ("Positions", "positions_png", "positions_csv", None),
    ("Table 1 measured", "complexity_png", "complexity_csv", "complexity"),
    ("Head ablation", "ablation_png", "ablation_csv", None),
    ("Cross-attention vs the grammar's alignment", None, "alignment_csv", "alignment"),
)

_STYLE = """body { font-family: sans-serif; margin: 1.5em; max-width: 1400px; }
img { max-width: 100%; border: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; } td, th { border: 1px solid #ccc; padding: 2px 6px; }
select { margin-right: 1em; } pre { background: #f6f6f6; padding: 1em; white-space: pre-wrap; }"""

# The map browser: MAPS ("kind/layer/head" -> image), LAYERS (kind -> count) and HEADS are defined first.
_SCRIPT = """function fill(id, n, keep) {
  const s = document.getElementById(id); const old = s.value; s.innerHTML = "";
  for (let i = 0; i < n; i++) {
    const o = document.createElement("option"); o.value = o.text = i; s.add(o);
  }
  if (keep && old !== "" && Number(old) < n) s.value = old;
}
function update() {
  const kind = document.getElementById("kind").value;
  fill("layer", LAYERS[kind], true);
  const layer = document.getElementById("layer").value, head = document.getElementById("head").value;
  const key = kind + "/" + layer + "/" + head;
  const all = document.getElementById("allheads").checked, grid = document.getElementById("grid");
  document.getElementById("map").src = MAPS[key];
  document.getElementById("map").style.display = all ? "none" : "";
  document.getElementById("maplink").href = MAPS[key];
  grid.innerHTML = "";
  for (let h = 0; all && h < HEADS; h++) {
    const img = document.createElement("img");
    img.src = MAPS[kind + "/" + layer + "/" + h]; img.style.maxWidth = "48%"; grid.appendChild(img);
  }
}"""


def _image_html(path: str, alt: str) -> str:
    path, alt = html.escape(path), html.escape(alt)
    return f'<p><a href="{path}"><img src="{path}" alt="{alt}"></a></p>'


def _table_html(rows: Sequence[dict[str, Any]], digits: int = 3) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(artifacts.fmt(r[c], digits))}</td>" for c in cols)
                   + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _sections_html(results: dict[str, Any]) -> str:
    files, parts = results["files"], []
    for title, png, table_file, rows_key in _SECTIONS:
        if png not in files and table_file not in files:
            continue
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if title == "Head ablation":
            parts.append(f"<p><b>{html.escape(WEIGHTS_ARE_NOT_EXPLANATIONS)}</b></p>")
        if png in files:
            parts.append(_image_html(files[png], title))
        if table_file in files:
            link = html.escape(files[table_file])
            parts.append(f'<p>Data: <a href="{link}">{link}</a></p>')
        if rows_key and results[rows_key]:
            parts.append(f"<details><summary>table</summary>{_table_html(results[rows_key])}</details>")
    return "".join(parts)


def write_html(path: str, results: dict[str, Any], manifest: Sequence[dict], sm: SentenceMaps,
               cfg: ModelConfig) -> str:
    """Writes the page linking every map of ``manifest`` and every file of ``results["files"]``; returns path.

    Args:
      results: ``report.run``'s results (with "summary" and "files": {key: path relative to the page}).
      manifest: ``maps.write_sentence_maps``'s manifest (images relative to ``maps/``).
    """
    files = results["files"]
    maps = {f"{m['kind']}/{m['layer']}/{m['head']}": "maps/" + m["image"] for m in manifest}
    layers = {kind: forward.num_layers(cfg, kind) for kind in forward.KINDS}
    first = forward.KINDS[0]
    options = "".join(f'<option value="{k}">{html.escape(forward.KIND_TITLES[k])}</option>'
                      for k in forward.KINDS)
    all_links = " ".join(f'<a href="{html.escape(p)}">{html.escape(k)}</a>' for k, p in maps.items())
    file_links = " &middot; ".join(f'<a href="{html.escape(p)}">{html.escape(p)}</a>' for p in files.values())
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>transformer_jax inspect: step {results['step']}</title>
<style>
{_STYLE}
</style></head><body>
<h1>Inside the Transformer: {html.escape(results['workdir'])}, step {results['step']}</h1>
<p>Source: <code>{html.escape(sm.source)}</code><br>Greedy output (drives the decoder maps):
<code>{html.escape(sm.output)}</code></p>
<h2>Attention maps</h2>
<p><label>Attention <select id="kind" onchange="update()">{options}</select></label>
<label>Layer <select id="layer" onchange="update()"></select></label>
<label>Head <select id="head" onchange="update()"></select></label>
<label><input type="checkbox" id="allheads" onchange="update()"> all heads of the layer</label>
<a id="maplink" href="#">open</a> &middot; numbers:
<a href="maps/attention_maps.npz">maps/attention_maps.npz</a>,
<a href="maps/manifest.json">maps/manifest.json</a></p>
<p><img id="map" src="{html.escape(maps[f'{first}/0/0'])}" alt="attention map"></p>
<div id="grid"></div>
<details><summary>all maps</summary><p>{all_links}</p></details>
<script>
const MAPS = {json.dumps(maps)};
const LAYERS = {json.dumps(layers)};
const HEADS = {cfg.num_heads};
{_SCRIPT}
fill("head", HEADS, false); fill("layer", LAYERS["{first}"], false); update();
</script>
{_sections_html(results)}
<h2>Summary</h2>
<p><a href="summary.md">summary.md</a> &middot; <a href="results.json">results.json</a></p>
<p>All files: {file_links}</p>
<pre>{html.escape(results['summary'])}</pre>
</body></html>
"""
    with open(path, "w") as f:
        f.write(page)
    return path
