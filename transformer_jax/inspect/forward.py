"""Restoring a workdir and running the model with its intermediates: attention records, masks, one sentence.

Attention kinds are ``encoder_self``, ``decoder_self`` and ``cross``; every other module of the package
indexes its results by them. Masks are boolean, True = may attend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import data as data_lib
from transformer_jax.checkpoints import restore
from transformer_jax.checkpoints.restore import Restored
from transformer_jax.evaluation import decode, paper
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import BOS_ID, EOS_ID, PAD_ID
from transformer_jax.model.transformer import Transformer
from transformer_jax.runtime.errors import ConfigError

KINDS = ("encoder_self", "decoder_self", "cross")
KIND_TITLES = {"encoder_self": "encoder self-attention", "decoder_self": "decoder masked self-attention",
               "cross": "encoder-decoder attention"}
# (stack, module) holding each kind in the parameter and intermediate trees.
MODULES = {"encoder_self": ("encoder", "self_attention"), "decoder_self": ("decoder", "self_attention"),
           "cross": ("decoder", "cross_attention")}


def kind_layer_order(key: tuple[str, int]) -> tuple[int, int]:
    """Sort key of a (kind, layer) pair: KINDS order, then layer."""
    return KINDS.index(key[0]), key[1]


def num_layers(model_config: ModelConfig, kind: str) -> int:
    """How many layers have an attention of ``kind``."""
    return model_config.num_encoder_layers if kind == "encoder_self" else model_config.num_decoder_layers


def restore_workdir(workdir: str, step: int | None = None) -> Restored:
    """The workdir's model, with a deterministic dense-attention config (the dense path sows weights)."""
    restored = restore.restore_workdir(workdir, step)
    model = restored.model_config.replace(deterministic=True, decode=False, attention_impl="dense",
                                          attention_witness=False)
    return dataclasses.replace(restored, run=dataclasses.replace(restored.run, model=model))


@dataclasses.dataclass(frozen=True)
class AttentionRecord:
    """What one attention sub-layer sowed (as NumPy arrays).

    Attributes:
      weights: float32[batch, heads, q_len, kv_len].
      queries: float32[batch, q_len, heads, d_k].
      keys: float32[batch, kv_len, heads, d_k].
    """

    weights: np.ndarray
    queries: np.ndarray
    keys: np.ndarray


@functools.lru_cache(maxsize=8)
def _forward_fn(model_config: ModelConfig):
    model = Transformer(model_config.replace(deterministic=True, decode=False, attention_impl="dense"))

    def forward(params, inputs, targets):
        logits, state = model.apply({"params": params}, inputs, targets, mutable=["intermediates"])
        return logits, state["intermediates"]

    return jax.jit(forward)


def attention_records(params: Any, model_config: ModelConfig, inputs: np.ndarray,
                      targets: np.ndarray) -> dict[str, list[AttentionRecord]]:
    """Teacher-forced forward that collects every attention's sown weights, queries and keys.

    Args:
      inputs: int[batch, src_len] source ids.
      targets: int[batch, tgt_len] target ids (the decoder reads ``shift_right(targets)``).

    Returns:
      {kind: one AttentionRecord per layer}, as NumPy arrays.
    """
    _, inter = _forward_fn(model_config)(params, jnp.asarray(inputs, jnp.int32),
                                         jnp.asarray(targets, jnp.int32))
    out = {}
    for kind, (stack, module) in MODULES.items():
        records = []
        for i in range(num_layers(model_config, kind)):
            sown = inter[stack][f"layer_{i}"][module]
            records.append(AttentionRecord(*(np.asarray(sown[name][0], np.float32)
                                             for name in ("attention_weights", "queries", "keys"))))
        out[kind] = records
    return out


def attention_mask(kind: str, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The keys each real query may attend to: bool[batch, 1, q_len, kv_len] (padded queries: no key).

    Args:
      inputs: int[batch, src_len]; targets: int[batch, tgt_len]. The decoder's position t is real when
        it predicts a real token (targets[:, t] != PAD).
    """
    src_ok = np.asarray(inputs) != PAD_ID  # [B, S]
    tgt_ok = np.asarray(targets) != PAD_ID  # [B, T]
    if kind == "encoder_self":
        return src_ok[:, None, :, None] & src_ok[:, None, None, :]
    if kind == "cross":
        return tgt_ok[:, None, :, None] & src_ok[:, None, None, :]
    if kind == "decoder_self":
        length = tgt_ok.shape[1]
        causal = np.tril(np.ones((length, length), bool))  # [T, T], key j <= query i
        return tgt_ok[:, None, :, None] & causal[None, None]
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def encode_sentence(tokenizer, sentence: str, max_len: int | None = None) -> np.ndarray:
    """int32[1, src_len]: the pieces of ``sentence`` plus EOS, as the data pipeline feeds the encoder.

    Raises ConfigError for an empty sentence, or one longer than ``max_len`` pieces (None: any length).
    """
    text = data_lib.normalize_whitespace(sentence)
    if not text:
        raise ConfigError("--sentence is empty; pass the source sentence whose attention maps to draw")
    ids = tokenizer.encode_text([text], side="source")[0] + [EOS_ID]
    if max_len is not None and len(ids) > max_len:
        raise ConfigError(
            f"--sentence is {len(ids)} pieces long with EOS ({len(text.split())} words); the model reads at "
            f"most max_len={max_len}; pass a shorter sentence")
    return np.asarray([ids], np.int32)


def greedy_output(params: Any, model_config: ModelConfig, inputs: np.ndarray, *,
                  max_extra_len: int = paper.MAX_EXTRA_LEN) -> np.ndarray:
    """int32[1, out_len]: the greedy output of one source int[1, src_len], up to and including its EOS.

    The output may be ``max_extra_len`` tokens longer than the source, but never longer than the
    model's ``max_len`` (a long source gets a smaller allowance).
    """
    max_extra_len = max(0, min(max_extra_len, model_config.max_len - inputs.shape[1]))
    tokens = np.asarray(decode.greedy_search(params, model_config, jnp.asarray(inputs),
                                             max_extra_len=max_extra_len))[0]
    tokens = tokens[tokens != PAD_ID]
    eos = np.flatnonzero(tokens == EOS_ID)
    if len(eos):
        tokens = tokens[: eos[0] + 1]
    if not len(tokens):
        tokens = np.asarray([EOS_ID], np.int32)
    return tokens[None].astype(np.int32)


def piece(tokenizer, token_id: int) -> str:
    """The SentencePiece piece of ``token_id``; the special ids as '<pad>', '</s>', '<s>'."""
    special = {PAD_ID: "<pad>", EOS_ID: "</s>", BOS_ID: "<s>"}
    return special.get(int(token_id)) or tokenizer.id_to_piece(int(token_id))


def pieces(tokenizer, ids: Sequence[int]) -> list[str]:
    """``piece`` of every id."""
    return [piece(tokenizer, i) for i in ids]


def dev_batches(restored: Restored, num_sentences: int, split: str = "dev") -> list:
    """The first ``num_sentences`` of ``split`` as padded evaluation batches; a longer example than the
    model takes raises DataError naming it."""
    return data_lib.make_eval_batches(restored.run.data, restored.tokenizer, split,
                                      max_examples=num_sentences,
                                      max_length=restored.model_config.position_limit)
