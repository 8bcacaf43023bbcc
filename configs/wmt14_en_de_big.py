"""The paper's big model on WMT 2014 EN->DE (Table 2: 28.4 BLEU; Table 3 big: 4.33 PPL, 26.4 BLEU).

As the base config, except (Table 3 "big"): d_model=1024, d_ff=4096, h=16, P_drop=0.3, 300k steps;
the paper averaged the last 20 checkpoints.
"""

from configs import wmt14_en_de_base as base_lib
from transformer_jax.evaluation import paper


def get_config():
    config = base_lib.get_config()
    config.name = "wmt14_en_de_big"
    big = paper.TABLE3_BY_NAME["big"]
    for name, value in big.model.items():  # d_model 1024, d_ff 4096, h 16 (d_k = d_v = 64), P_drop 0.3
        config.model[name] = value
    config.train.num_steps = big.num_steps  # 300k
    config.final_average_last = paper.AVERAGE_LAST["big"]
    return config
