"""Translating sentences with a trained model: the one decoding path of translate, evaluate.py and dev BLEU.

Sentences are token ids with EOS appended. They are sorted by length and packed into batches by a
decoding token budget (:func:`plan_batches`), searched with ``decode.greedy_search`` (``beam_size=1``)
or ``decode.beam_search``, and returned in the input order. A batch of sources padded to length ``L``
holds ``rows = tokens_per_batch // (beams * (L + max_extra_len))`` sentences (a multiple of 8): the
search runs ``rows * beams`` decoder rows against a cache of ``L + max_extra_len`` positions, so the
budget bounds the cache and gives short sentences many rows per matrix product.

Outputs do not depend on the batching: example i may output ``src_len_i + max_extra_len`` tokens
(``decode``'s length limit), whatever its batch's padded length, so translations equal those of one
batch holding every sentence.

Shapes are few so that compilation stays cheap: ``L`` is a multiple of 8 up to 64, then grows by 1.25
(``eval_batches.extended_buckets``), the last one cut to the longest sentence. Sentences a length
cannot fill a batch with move up to the next length, so only the last batch is partial, and its rows
are rounded up to four sizes an octave (:func:`padded_rows`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from transformer_jax.checkpoints.restore import averaged_params, restore_workdir
from transformer_jax.data.eval_batches import extended_buckets
from transformer_jax.data.sources import normalize_whitespace
from transformer_jax.data.treebank import is_parsing
from transformer_jax.evaluation import ctranslate2_engine, decode, paper
from transformer_jax.model.config import ModelConfig
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.runtime.errors import ConfigError, DataError, MissingFileError
from transformer_jax.runtime.output_file import OutputFile, write_stdout

# The default batch budget: decoder rows x cache positions whose self-attention keys and values take
# this much memory. 192k positions for the Multi30k model (4 KiB each: 4 layers x 4 heads x (32 + 32)
# float32), 32k for the base model. Against half the budget it compiles half the batch shapes for the same
# speed once compiled (docs/benchmarks.md).
CACHE_BYTES_PER_BATCH = 768 * 2**20
_LENGTHS = (8, 16, 24, 32, 40, 48, 56, 64)  # padded source lengths; longer ones grow by 1.25
_ROW_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class Settings:
    """How to decode: ``beam_size`` 1 is greedy search; ``alpha`` is the GNMT length penalty."""

    beam_size: int = paper.BEAM_SIZE
    alpha: float = paper.LENGTH_PENALTY_ALPHA
    max_extra_len: int = paper.MAX_EXTRA_LEN


@dataclasses.dataclass(frozen=True)
class Batch:
    """One planned batch: sentences ``indices`` int64[num_real], padded to ``src_len`` and ``rows`` rows."""

    indices: np.ndarray
    src_len: int
    rows: int


def default_tokens_per_batch(model_config: ModelConfig) -> int:
    """The budget of :func:`plan_batches` whose self-attention cache takes ``CACHE_BYTES_PER_BATCH``."""
    cfg = model_config
    position_bytes = (cfg.num_decoder_layers * cfg.num_heads * (cfg.d_k + cfg.d_v)
                      * np.dtype(cfg.compute_dtype).itemsize)
    return max(1, CACHE_BYTES_PER_BATCH // position_bytes)


def plan_batches(lengths: Sequence[int], *, beams: int, max_extra_len: int, tokens_per_batch: int,
                 max_src_len: int | None = None) -> list[Batch]:
    """Batches covering every sentence exactly once, shortest first.

    Args:
      lengths: int[n] token counts, EOS included (all >= 1).
      beams: decoder rows per sentence (the beam size; 1 for greedy).
      max_extra_len: output positions beyond the source (the cache is ``src_len + max_extra_len``).
      tokens_per_batch: the budget of ``beams * rows * (src_len + max_extra_len)``; at least 8 rows.
      max_src_len: no batch is padded beyond this (the model's position table); >= every length.

    Returns:
      Batches in increasing ``src_len``; within one, sentences by length then by index.
    """
    lengths = np.asarray(lengths, np.int64)
    if not len(lengths):
        return []
    longest = int(lengths.max())
    buckets = extended_buckets(_LENGTHS, longest)
    buckets = buckets[:int(np.searchsorted(buckets, longest)) + 1]  # none beyond the longest sentence's
    if max_src_len is not None and buckets[-1] > max_src_len:
        buckets = [b for b in buckets if b < max_src_len] + [max_src_len]
    bucket_of = np.searchsorted(np.asarray(buckets), lengths)  # the smallest bucket >= length
    batches, carried = [], np.zeros(0, np.int64)
    for b, src_len in enumerate(buckets):
        size = tokens_per_batch // (beams * (src_len + max_extra_len))
        size = max(_ROW_MULTIPLE, size // _ROW_MULTIPLE * _ROW_MULTIPLE)
        members = np.flatnonzero(bucket_of == b)
        members = np.concatenate([carried, members[np.argsort(lengths[members], kind="stable")]])
        last = b == len(buckets) - 1
        full = len(members) if last else len(members) - len(members) % size
        for start in range(0, full, size):
            real = members[start:min(start + size, full)]
            rows = size if len(real) == size else min(size, padded_rows(len(real)))
            batches.append(Batch(real, src_len, rows))
        carried = members[full:]
    return batches


def padded_rows(n: int) -> int:
    """Rows for a partial batch of n sentences: 1, 2, 4 or 8 up to 8, then a multiple of 8 that is
    1, 1.25, 1.5 or 1.75 times a power of two (144 -> 160), so that a padding row costs at most a
    quarter more and few shapes are compiled. A padding row runs every step as a sentence does."""
    if n <= _ROW_MULTIPLE:
        return 1 << (n - 1).bit_length()
    step = max(_ROW_MULTIPLE, 1 << ((n - 1).bit_length() - 3))
    return -(-n // step) * step


def _padded(ids: Sequence[np.ndarray], indices: np.ndarray, rows: int, src_len: int) -> np.ndarray:
    """int32[rows, src_len]: the sentences ``indices`` right-padded with PAD, then all-PAD rows."""
    out = np.full((rows, src_len), PAD_ID, np.int32)
    for r, i in enumerate(indices):
        out[r, :len(ids[i])] = ids[i]
    return out


def decode_ids(params: Any, model_config: ModelConfig, ids: Sequence[np.ndarray], settings: Settings,
               *, tokens_per_batch: int | None = None,
               progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """Searches every sentence; returns the outputs in the input order.

    Args:
      params: the model parameters.
      model_config: the model (decoded deterministically).
      ids: int32[len_i] source ids, EOS included; each ``len_i + max_extra_len <= model max_len``.
      settings: the search.
      tokens_per_batch: the batch budget of :func:`plan_batches`; None: the model's
        :func:`default_tokens_per_batch`.
      progress: called with the number of sentences each batch finished.

    Returns:
      Each output int32[len_i + max_extra_len] in ``decode``'s convention (tokens, then EOS, then PAD),
      whatever the batch it was decoded in.
    """
    if any(len(s) + settings.max_extra_len > model_config.max_len for s in ids):
        raise ValueError(f"a source longer than model max_len={model_config.max_len} - max_extra_len="
                         f"{settings.max_extra_len} tokens; check lengths first (translate_texts does)")
    beams = settings.beam_size
    if tokens_per_batch is None:
        tokens_per_batch = default_tokens_per_batch(model_config)
    outputs: list[np.ndarray | None] = [None] * len(ids)

    def collect(batch: Batch, tokens) -> None:
        tokens = np.asarray(tokens)  # waits for the search
        for r, i in enumerate(batch.indices):  # each to its own limit: PAD beyond it in any batch
            outputs[i] = tokens[r, :len(ids[i]) + settings.max_extra_len]
        if progress is not None:
            progress(len(batch.indices))

    # A search runs while the next batch is traced and compiled (dispatch is asynchronous), so each
    # batch is collected only after the next one has been dispatched.
    pending = None
    for batch in plan_batches([len(s) for s in ids], beams=beams, max_extra_len=settings.max_extra_len,
                              tokens_per_batch=tokens_per_batch,
                              max_src_len=model_config.max_len - settings.max_extra_len):
        inputs = _padded(ids, batch.indices, batch.rows, batch.src_len)
        max_len = min(batch.src_len + settings.max_extra_len, model_config.max_len)
        if beams == 1:
            tokens = decode.greedy_search(params, model_config, inputs, max_len=max_len,
                                          max_extra_len=settings.max_extra_len)
        else:
            tokens, _ = decode.beam_search(params, model_config, inputs, beam_size=beams,
                                           alpha=settings.alpha, max_len=max_len,
                                           max_extra_len=settings.max_extra_len)
        if pending is not None:
            collect(*pending)
        pending = (batch, tokens)
    if pending is not None:
        collect(*pending)
    return outputs


def source_ids(tokenizer, texts: Sequence[str], *, max_length: int, truncate: bool = False,
               locations: Sequence[str] | None = None) -> list[np.ndarray]:
    """int32 token ids of each text (whitespace normalized) with EOS appended.

    A text of more than ``max_length`` tokens (EOS included) is cut to that length when ``truncate``
    (EOS kept last); otherwise it raises DataError naming it by ``locations[i]`` or its line number.
    """
    encoded = tokenizer.encode_text([normalize_whitespace(t) for t in texts], side="source")
    ids = []
    for i, pieces in enumerate(encoded):
        if len(pieces) + 1 > max_length:
            if not truncate:
                where = locations[i] if locations is not None else f"line {i + 1}"
                raise DataError(
                    f"{where}: {len(pieces) + 1} tokens (EOS included), more than the {max_length} this "
                    "model can decode; shorten or split the line, pass --truncate to cut it, or decode "
                    "with a smaller --max_extra_len")
            pieces = pieces[:max_length - 1]
        ids.append(np.asarray([*pieces, EOS_ID], np.int32))
    return ids


def translate_texts(params: Any, model_config: ModelConfig, tokenizer, texts: Sequence[str],
                    settings: Settings, *, truncate: bool = False,
                    tokens_per_batch: int | None = None,
                    locations: Sequence[str] | None = None,
                    progress: Callable[[int], None] | None = None,
                    decode_fn: Callable[..., list[np.ndarray]] | None = None) -> list[str]:
    """Detokenized translations of ``texts``, in their order; an empty (or blank) text gives "".

    A text too long for the model raises DataError naming it (see :func:`source_ids`) unless
    ``truncate``. ``decode_fn(ids, settings, progress=...)`` replaces :func:`decode_ids` (then
    ``params`` is unused), e.g. ``ctranslate2_engine.Engine.decode_ids``.
    """
    keep = [i for i, t in enumerate(texts) if normalize_whitespace(t)]
    max_length = model_config.max_len - settings.max_extra_len
    if max_length < 1:
        raise DataError(f"max_extra_len={settings.max_extra_len} leaves no room for a source in the "
                        f"model's max_len={model_config.max_len}; pass a smaller --max_extra_len")
    ids = source_ids(tokenizer, [texts[i] for i in keep], max_length=max_length, truncate=truncate,
                     locations=[locations[i] if locations else f"line {i + 1}" for i in keep])
    if decode_fn is None:
        outputs = decode_ids(params, model_config, ids, settings, tokens_per_batch=tokens_per_batch,
                             progress=progress)
    else:
        outputs = decode_fn(ids, settings, progress=progress)
    translations = [""] * len(texts)
    for i, text in zip(keep, tokenizer.decode_batch(outputs), strict=True):
        translations[i] = text
    if progress is not None and len(keep) < len(texts):
        progress(len(texts) - len(keep))
    return translations


def progress_bar(total: int, enabled: bool):
    """A tqdm bar over ``total`` sentences on stderr (a no-op object when not ``enabled``)."""
    import tqdm

    return tqdm.tqdm(total=total, unit="sent", file=sys.stderr, disable=not enabled, dynamic_ncols=True,
                     mininterval=0.5, delay=1.0)  # delay: an error found at once prints no bar first


def read_lines(path: str | None) -> list[str]:
    """The lines of ``path`` (stdin when None), without their line ends.

    Raises DataError naming the line for bytes that are not UTF-8 and for a NUL byte (a binary file).
    """
    if path is None:
        data, name = sys.stdin.buffer.read(), "<stdin>"
    else:
        if os.path.isdir(path):
            raise ConfigError(f"--input={path} is a folder; expected a text file, one sentence a line")
        if not os.path.isfile(path):
            raise MissingFileError(f"--input={path}: no such file")
        with open(path, "rb") as f:
            data = f.read()
        name = path
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":  # the final line end, not an empty last line
        lines.pop()
    texts = []
    for number, line in enumerate(lines, 1):
        if b"\0" in line:
            raise DataError(f"{name}:{number}: a NUL byte; expected UTF-8 text, one sentence a line (is "
                            "it a binary file?)")
        try:
            texts.append(line.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError as e:
            raise DataError(f"{name}:{number}: byte 0x{line[e.start]:02x} at column {e.start + 1} is not "
                            "UTF-8; convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    return texts


def _check_at_least(flag: str, value, minimum, what: str) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"--{flag}={value}: expected >= {minimum} ({what})")


ENGINES = ("jax", "ctranslate2")


def translate_workdir(workdir: str, *, input_path: str | None = None, output_path: str | None = None,
                      step: int | None = None, average_last: int | None = None,
                      beam_size: int | None = None,
                      alpha: float | None = None, max_extra_len: int | None = None,
                      truncate: bool = False, tokens_per_batch: int | None = None,
                      show_progress: bool | None = None, engine: str = "jax", threads: int | None = None,
                      export_dir: str | None = None) -> dict[str, Any]:
    """Translates the lines of ``input_path`` (or stdin) with a ``train.py`` workdir, into ``output_path``.

    Writes one translation a line, in the input order, to ``output_path`` or stdout.

    Settings left at None take the run config's ``final_average_last``, ``final_beam_size``,
    ``final_alpha`` and ``final_max_extra_len``. Every flag, the output path and the input are checked
    before the model is restored; ``output_path`` is replaced whole at the end, or not at all. The
    progress bar (stderr) shows by default when the input is a file or redirected.

    ``engine="ctranslate2"`` decodes with the export in ``export_dir`` (default
    ``<workdir>/export/ctranslate2``, made first when missing) on ``threads`` CPU threads
    (``ctranslate2_engine``); the JAX engine is the reference.

    Returns:
      ``num_sentences``, ``decode_seconds`` (search and detokenization, compilation included),
      ``sentences_per_second`` and ``target_tokens_per_second`` (SentencePiece tokens of the outputs).
    """
    for flag, value, minimum, what in (
            ("step", step, 0, "a saved checkpoint step; leave it out for the latest"),
            ("average_last", average_last, 0, "0 or 1: no averaging; N: the last N checkpoints"),
            ("beam_size", beam_size, 1, "1 is greedy search"),
            ("alpha", alpha, 0, "the GNMT length penalty; 0 turns it off"),
            ("max_extra_len", max_extra_len, 0, "outputs may be input length + this long"),
            ("tokens_per_batch", tokens_per_batch, 1, "decoder rows x cache positions per batch"),
            ("threads", threads, 0, "CPU threads of CTranslate2; 0: its default")):
        _check_at_least(flag, value, minimum, what)
    if engine not in ENGINES:
        raise ConfigError(f"--engine={engine}: expected one of {', '.join(ENGINES)}")
    if engine == "jax":
        for flag, value in (("threads", threads), ("export_dir", export_dir)):
            if value is not None:
                raise ConfigError(f"--{flag} applies to --engine=ctranslate2; the JAX engine uses every "
                                  "core and the workdir's checkpoints")
    else:
        if tokens_per_batch is not None:
            raise ConfigError("--tokens_per_batch applies to the JAX engine; CTranslate2 plans its own "
                              "batches")
        ctranslate2_engine.import_ctranslate2()  # the install hint before anything is read
    if not os.path.isdir(workdir):
        raise MissingFileError(f"--workdir={workdir}: no such directory; pass the --workdir of a "
                               "train.py run")
    # The output path is checked (and its temporary file made) before anything is read or decoded.
    with OutputFile(output_path) if output_path is not None else contextlib.nullcontext() as output:
        lines = read_lines(input_path)
        if engine == "jax":
            model = _jax_model(workdir, step, average_last, tokens_per_batch)
        else:
            model = _exported_model(workdir, export_dir, step, average_last, threads)
        return _translate_lines(model, lines, output, input_path=input_path, beam_size=beam_size,
                                alpha=alpha, max_extra_len=max_extra_len, truncate=truncate,
                                show_progress=show_progress)


@dataclasses.dataclass(frozen=True)
class _Model:
    """What translating needs from a model, whichever engine decodes: see ``translate_texts``."""

    params: Any
    model_config: ModelConfig
    tokenizer: Any
    defaults: Settings
    step: int
    average_last: int
    engine: str
    tokens_per_batch: int | None = None  # the JAX engine's batch budget
    decode_fn: Callable[..., list[np.ndarray]] | None = None  # another engine's decode_ids
    compute_type: str | None = None  # CTranslate2's, as it runs on this machine


def _jax_model(workdir: str, step, average_last, tokens_per_batch) -> _Model:
    restored = restore_workdir(workdir, step)
    if is_parsing(restored.run.data):
        raise ConfigError(f"--workdir={workdir} is a parsing run; translate decodes translation runs. "
                          f"Parse with: python evaluate.py --workdir={workdir} (trees over the input words)")
    final = restored.run.eval
    if average_last is None:
        average_last = final.final_average_last
    params, _ = averaged_params(restored, average_last)
    defaults = Settings(final.final_beam_size, final.final_alpha, final.final_max_extra_len)
    return _Model(params, restored.model_config, restored.tokenizer, defaults, restored.step, average_last,
                  "jax", tokens_per_batch=tokens_per_batch)


def _exported_model(workdir: str, export_dir, step, average_last, threads) -> _Model:
    from transformer_jax.data.text_form import TextForm
    from transformer_jax.data.tokenizer import Tokenizer

    export_dir = export_dir or ctranslate2_engine.default_export_dir(workdir)
    if not os.path.isfile(os.path.join(export_dir, ctranslate2_engine.RECORD_FILE)):
        print(f"exporting the model to {export_dir} first (once; python -m transformer_jax.export)",
              file=sys.stderr)
        ctranslate2_engine.export_workdir(workdir, out_dir=export_dir, step=step, average_last=average_last)
    record = ctranslate2_engine.read_record(export_dir)
    for flag, value in (("step", step), ("average_last", average_last)):
        if value is not None and value != record[flag]:
            raise ConfigError(
                f"--{flag}={value}, but {export_dir} holds {flag} {record[flag]}; export that model first: "
                f"python -m transformer_jax.export --workdir={workdir} --{flag}={value}")
    latest = _latest_checkpoint_step(workdir)
    if step is None and latest is not None and latest > record["step"]:
        print(f"note: {export_dir} is step {record['step']}; the workdir has step {latest} (export again "
              f"to use it: python -m transformer_jax.export --workdir={workdir})", file=sys.stderr)
    engine = ctranslate2_engine.Engine(export_dir, threads=threads or 0)
    tokenizer = Tokenizer.from_file(os.path.join(export_dir, ctranslate2_engine.TOKENIZER_FILE),
                                    text_form=TextForm(**record["text_form"]))
    decoding = record["decoding"]
    defaults = Settings(decoding["beam_size"], decoding["alpha"], decoding["max_extra_len"])
    return _Model(None, ModelConfig(**record["model"]), tokenizer, defaults, record["step"],
                  record["average_last"], "ctranslate2", decode_fn=engine.decode_ids,
                  compute_type=engine.compute_type)


def _latest_checkpoint_step(workdir: str) -> int | None:
    """The newest step folder in the workdir's checkpoints (by name; nothing is read), or None."""
    try:
        names = os.listdir(os.path.join(workdir, "checkpoints"))
    except OSError:
        return None
    return max((int(n) for n in names if n.isdigit()), default=None)


def _translate_lines(model: _Model, lines: list[str], output: OutputFile | None, *, input_path, beam_size,
                     alpha, max_extra_len, truncate, show_progress) -> dict[str, Any]:
    settings = Settings(
        beam_size=model.defaults.beam_size if beam_size is None else beam_size,
        alpha=model.defaults.alpha if alpha is None else alpha,
        max_extra_len=model.defaults.max_extra_len if max_extra_len is None else max_extra_len)
    name = input_path or "<stdin>"
    if show_progress is None:
        show_progress = input_path is not None or not sys.stdin.isatty()
    start = time.perf_counter()
    with progress_bar(len(lines), show_progress) as bar:
        translations = translate_texts(
            model.params, model.model_config, model.tokenizer, lines, settings, truncate=truncate,
            tokens_per_batch=model.tokens_per_batch, locations=[f"{name}:{i + 1}" for i in range(len(lines))],
            progress=bar.update, decode_fn=model.decode_fn)
    seconds = time.perf_counter() - start
    text = "".join(t + "\n" for t in translations)
    if output is None:
        write_stdout(text)
    else:
        output.write(text)
    target_tokens = sum(len(ids) for ids in model.tokenizer.encode_text(translations, side="target"))
    return {"num_sentences": len(lines), "decode_seconds": seconds,
            "sentences_per_second": len(lines) / seconds, "target_tokens_per_second": target_tokens / seconds,
            "beam_size": settings.beam_size, "alpha": settings.alpha, "step": model.step,
            "average_last": model.average_last, "engine": model.engine,
            **({"compute_type": model.compute_type} if model.compute_type else {})}
