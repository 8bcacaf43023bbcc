"""Builds a run config's data cache ahead of training.

    python -m transformer_jax.prepare_cache --config=configs/wmt14_en_de_base.py [--config.data.x=y]

Trains the config's shared tokenizer and encodes its train split into the data cache
(``data/corpus_cache.py``), as the first ``train.py`` on that data would; run it on a login node before
submitting, and every run on the same data then starts in seconds. It prints where the entries are. The
downloads of raw data sets are ``python -m transformer_jax.data.prepare``'s; this command reads a run
config, so it lives beside the other entry points, above ``data/``. A user error prints two lines and
exits 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import flags

from transformer_jax import run_config
from transformer_jax.data import corpus_cache, disk_cache, sources, tokenizer
from transformer_jax.runtime import errors

USAGE = "usage: python -m transformer_jax.prepare_cache --config=CONFIG [--config.data.x=y]"


def prepare_cache(config: Any) -> tuple[Path, int]:
    """Builds (or finds) the data cache of a run config: (the cache root, the train pairs it holds)."""
    run = run_config.build_run_config(config, environment=False)
    if not corpus_cache.is_cached(run.data):
        raise errors.ConfigError(f"config.data.source={run.data.source!r} is built in memory at start-up; "
                                 f"only the sources {corpus_cache.CACHED_SOURCES} have a data cache")
    sources.check_input_files(run.data, ("train",))
    proto = corpus_cache.shared_tokenizer(run.data)
    split = corpus_cache.open_train_split(run.data, tokenizer.Tokenizer(proto))
    return disk_cache.cache_root(run.data.cache_dir), len(split)


def main(argv: Sequence[str]) -> None:
    config = flags.FLAGS["config"].value
    if config is None:
        raise errors.ConfigError(f"--config=CONFIG is required (a configs/*.py file); {USAGE}")
    root, num_pairs = prepare_cache(config)
    print(f"Data cache ready in {root}: the tokenizer and {num_pairs:,} encoded train pairs")


if __name__ == "__main__":
    run_config.define_config_file("config", None, "The run config whose data to prepare.", lock_config=True)
    errors.run_main(main)
