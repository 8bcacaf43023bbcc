"""The exact parameter count of every Table 3 row beside the paper's rounded x10^6.

    python -m transformer_jax.params_table [--vocab_size=37000]

A row's model is ``ModelConfig(vocab_size=v, **row.model)``: the paper's base model is ModelConfig's
defaults, and ``paper.TABLE3`` rows override it; the rows beyond the paper (``paper.TABLE3_BEYOND``, E+:
other position schemes) follow row E. Counts come from ``model_config.param_count`` (no
initialization). The paper rounds to millions and does not give its exact vocabulary, so the table also
says which vocabulary each printed count implies.
"""

from __future__ import annotations

from absl import flags

from transformer_jax.evaluation import paper
from transformer_jax.model.config import ModelConfig, param_count
from transformer_jax.runtime import errors


def row_model_config(row: paper.Table3Row | paper.BeyondTable3Row, vocab_size: int) -> ModelConfig:
    """The row's model at paper scale: ModelConfig's defaults (the base model) with the row's overrides."""
    return ModelConfig(vocab_size=vocab_size, **row.model)


def implied_vocab_size(row: paper.Table3Row) -> float:
    """The shared vocabulary that would make the row's count equal the paper's ``params_millions``."""
    without_vocab = row_model_config(row, vocab_size=1)
    layers = param_count(without_vocab) - without_vocab.d_model  # everything but the embedding table
    return (row.params_millions * 1e6 - layers) / without_vocab.d_model


def parameter_table(vocab_size: int) -> str:
    """Markdown: one line per Table 3 row (exact count, x10^6, the paper's x10^6), the rows beyond the
    paper (E+, other position schemes) after row E, then notes."""
    lines = [f"Shared vocabulary: {vocab_size}.",
             "| row | changes | params (exact) | x10^6 | paper x10^6 |", "|---|---|---:|---:|---:|"]
    gaps = []
    for row in paper.TABLE3_ALL:
        count = param_count(row_model_config(row, vocab_size))
        printed = getattr(row, "params_millions", None)
        if printed is not None:
            gaps.append((abs(count / 1e6 - printed), row.name))
        changes = ", ".join(f"{k}={v}" for k, v in {**row.model, **row.train}.items()) or "-"
        theirs = "beyond the paper" if row.name in paper.TABLE3_BEYOND_BY_NAME else (
            "-" if printed is None else str(printed))
        lines.append(f"| {row.name} | {changes} | {count:,} | {count / 1e6:.1f} | {theirs} |")
    base, big = paper.TABLE3_BY_NAME["base"], paper.TABLE3_BY_NAME["big"]
    gap, gap_row = max(gaps)
    base_config = row_model_config(base, vocab_size)
    relative_tables = (param_count(base_config.replace(position_encoding="relative"))
                       - param_count(base_config))
    lines.append(
        f"\nThe paper rounds to millions and does not give its exact vocabulary: its base row implies "
        f"{implied_vocab_size(base) / 1e3:.1f}k shared tokens and its big row "
        f"{implied_vocab_size(big) / 1e3:.1f}k, so no single vocabulary matches every row. Largest gap "
        f"here: {gap:.1f}M ({gap_row}). Learned positions (E) add two max_len x d_model tables; relative "
        "positions (E+) one a^K [2k+1, d_k] and one a^V [2k+1, d_v] table per self-attention layer "
        f"({relative_tables:,} at the base row, k={base_config.max_relative_position}); rotary, ALiBi and no "
        "positions add none. Attention projections have no biases, as in the paper's equations.")
    return "\n".join(lines)


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.params_table``."""
    flags.DEFINE_integer(
        "vocab_size", paper.VOCAB_EN_DE,
        "Shared source/target vocabulary of the counted models (the paper's EN-DE BPE is 'about 37000').",
        flag_values=flag_values)


def main(argv: list[str]) -> None:
    print(parameter_table(flags.FLAGS.vocab_size))


if __name__ == "__main__":
    define_flags()
    errors.run_main(main)
