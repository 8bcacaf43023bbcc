"""Sweeps: the paper's Table 3 or a cartesian grid, run here, printed, or written as a SLURM array.

    python -m transformer_jax.sweep --grid table3 [--rows A,E] --scale multi30k --workdir runs/t3m
    python -m transformer_jax.sweep --grid table3 --rows E,E+ --seeds 3 --scale cpu --workdir runs/t3e
    python -m transformer_jax.sweep --grid table3 --scale paper --workdir runs/t3 --launcher slurm
    python -m transformer_jax.sweep --grid 'model.num_heads=1,4,8 model.dropout_rate=0.0,0.1' \\
        --config configs/default.py --workdir runs/heads --launcher print
    python -m transformer_jax.sweep report --workdir runs/table3
    python -m transformer_jax.sweep params [--scale paper|cpu|multi30k] [--rows C]

A sweep is a list of rows; each row is a config (``configs/table3.py:<row>,<scale>``, or ``--config`` plus
``--config.<key>=<value>`` overrides) trained by ``train.py`` into ``<workdir>/<row>`` and scored on the
dev split by ``evaluate.py``. Every row's config is loaded as train.py loads it (ml_collections'
config_flags) and validated before anything trains, so an unknown key, a value of the wrong type or an
invalid model fails at once. Table 3's group E+ (row E with rotary, ALiBi, relative and no positions) is
beyond the paper: its rows are never compared with a paper figure.

Modules, in the order data flows:
  grid.py       rows: Table 3 rows and generic grids, loaded and validated
  launchers.py  the local, print and slurm launchers and the workdir's manifest (``sweep.json``)
  report.py     results -> ``report.md``, ``report.csv``, ``report.png``; the ``params`` table
  __main__.py   the command line (absl flags)
"""
