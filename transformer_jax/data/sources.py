"""Parallel-text sources behind one interface: synthetic, plain-text files, TFDS.

Every source has `pairs(split) -> Sequence[tuple[str, str]]` with split in
{'train', 'dev', 'test'}, giving (source_text, target_text) with whitespace normalised
(`normalize_whitespace`). `SyntheticSource` and `TextSource` return lists. `TfdsSource` returns
lists for 'dev'/'test' and, for 'train', a lazily indexable `TfdsPairs` sequence (len, int and
slice indexing) so that WMT's 4.5M pairs are read in chunks rather than held as strings.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, overload

from transformer_jax.data.config import validate_data_config
from transformer_jax.data.synthetic import SyntheticSource
from transformer_jax.data.treebank import PARSING_SOURCES, TreebankSource
from transformer_jax.runtime.errors import DataError, MissingFileError, UserError

SPLITS = ("train", "dev", "test")

# ASCII whitespace and U+00A0 (no-break space) become one space. Other Unicode spaces (U+2009 in
# newstest2013.en) are kept: they are characters of the text, not layout.
_WHITESPACE = re.compile(r"[ \t\r\n\f\v\u00a0]+")


def normalize_whitespace(text: str) -> str:
    """U+00A0, TAB and other ASCII whitespace -> one space; runs collapsed; ends stripped."""
    return _WHITESPACE.sub(" ", text).strip()


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


class Source(Protocol):
    """Anything with `pairs(split)`; see the module docstring."""

    def pairs(self, split: str) -> Sequence[tuple[str, str]]: ...


# ----------------------------------------------------------------------------- text files


def read_lines(path: Path, *, expected: str) -> list[str]:
    """Lines of a UTF-8 file, whitespace-normalised (empty lines kept as '').

    Raises:
      MissingFileError (a FileNotFoundError): naming `path` and `expected` (what it should hold).
      DataError (a ValueError): the file is empty, or not valid UTF-8 (naming the 1-based line).
    """
    if not path.is_file():
        raise MissingFileError(f"{path}: no such file; expected {expected}")
    data = path.read_bytes()
    if not data:
        raise DataError(f"{path}: file is empty; expected {expected}")
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}:{line}: invalid UTF-8 ({e.reason} at byte {e.start}); expected {expected}"
        ) from None
    # split('\n'), not splitlines(): U+2028, U+0085 etc. are characters of a line, not breaks.
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # final newline
    return [normalize_whitespace(line) for line in lines]


class TextSource:
    """Line-aligned files `{dir}/{prefix}.{src_lang}` and `{dir}/{prefix}.{tgt_lang}`.

    Pairs where either side is empty after normalisation are skipped; `num_skipped[split]`
    counts them (also logged as a warning, which train.py shows); `line_numbers[split]` holds each
    kept pair's 1-based line number.
    """

    def __init__(self, directory: str, prefixes: dict[str, str], src_lang: str, tgt_lang: str):
        self.dir = Path(directory)
        self.prefixes = prefixes
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.num_skipped: dict[str, int] = {}
        self.line_numbers: dict[str, list[int]] = {}
        self._cache: dict[str, list[tuple[str, str]]] = {}

    def paths(self, split: str) -> tuple[Path, Path]:
        prefix = self.prefixes[split]
        return self.dir / f"{prefix}.{self.src_lang}", self.dir / f"{prefix}.{self.tgt_lang}"

    def pairs(self, split: str) -> list[tuple[str, str]]:
        _check_split(split)
        if split not in self._cache:
            self._cache[split] = self._read(split)
        return self._cache[split]

    def _read(self, split: str) -> list[tuple[str, str]]:
        pairs, self.line_numbers[split], self.num_skipped[split] = _read_parallel(
            *self.paths(split), split=split)
        return pairs


def _read_parallel(
    src_path: Path, tgt_path: Path, *, split: str
) -> tuple[list[tuple[str, str]], list[int], int]:
    """(pairs, each pair's 1-based line number, number of pairs skipped for an empty side)."""
    what = f"the {split} split, one sentence per line, line-aligned with {{}}"
    src = read_lines(src_path, expected=what.format(tgt_path))
    tgt = read_lines(tgt_path, expected=what.format(src_path))
    if len(src) != len(tgt):
        raise DataError(
            f"line counts differ: {src_path} has {len(src)} lines, {tgt_path} has"
            f" {len(tgt)} lines; the files must be line-aligned"
        )
    for path, lines in ((src_path, src), (tgt_path, tgt)):
        warn_suspicious_lines(path, lines)
    blank = [i + 1 for i, (s, t) in enumerate(zip(src, tgt, strict=True)) if not (s and t)]
    if blank:  # a warning, not info: train.py and evaluate.py show warnings
        logging.warning("%s", blank_pairs_warning(f"{src_path} / {tgt_path}", blank, len(src)))
    if len(blank) == len(src):
        raise DataError(f"{src_path} / {tgt_path}: no pair has both sides non-empty")
    lines = [i + 1 for i, (s, t) in enumerate(zip(src, tgt, strict=True)) if s and t]
    return [(src[i - 1], tgt[i - 1]) for i in lines], lines, len(blank)


# SentencePiece trains on lines up to this many bytes (tokenizer.py sets max_sentence_length to it) and
# skips longer ones, so their rare characters may have no piece (<unk>).
LONG_LINE_BYTES = 1 << 16


def first_lines(numbers: Sequence[int]) -> str:
    """The first five of ``numbers``, comma-separated, and '...' if there are more."""
    return ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")


def suspicious_lines(lines: Sequence[str], first: int = 1) -> dict[str, list[int]]:
    """Line numbers (counted from ``first``) of the lines holding a NUL byte ('nul') and of those too long
    for the tokenizer to train on ('long')."""
    return {"nul": [first + i for i, line in enumerate(lines) if "\0" in line],
            "long": [first + i for i, line in enumerate(lines) if len(line) * 4 > LONG_LINE_BYTES
                     and len(line.encode("utf-8")) > LONG_LINE_BYTES]}


def suspicious_line_warnings(path: Path | str, found: dict[str, list[int]], num_lines: int) -> list[str]:
    """The warnings for ``suspicious_lines``'s ``found`` in ``path`` of ``num_lines`` lines."""
    warnings = []
    if found["nul"]:
        warnings.append(f"{path}: {len(found['nul'])} of {num_lines} lines hold a NUL byte (lines "
                        f"{first_lines(found['nul'])}); binary data or a broken conversion? It becomes <unk>")
    if found["long"]:
        warnings.append(f"{path}: {len(found['long'])} of {num_lines} lines are longer than "
                        f"{LONG_LINE_BYTES} bytes (lines {first_lines(found['long'])}); the tokenizer does "
                        "not train on them and they may become <unk> pieces")
    return warnings


def warn_suspicious_lines(path: Path, lines: Sequence[str]) -> dict[str, list[int]]:
    """Warns (naming ``path`` and the 1-based lines) about NUL bytes and lines too long to train on.

    Returns ``{"nul": [...], "long": [...]}``, the line numbers found. Both are kept in the data: a NUL
    is a character of the text as far as the file says, but it usually means binary data or a broken
    conversion, and it becomes an <unk> piece.
    """
    found = suspicious_lines(lines)
    for warning in suspicious_line_warnings(path, found, len(lines)):
        logging.warning("%s", warning)
    return found


def blank_pairs_warning(where: str, blank: Sequence[int], num_pairs: int) -> str:
    """The warning for the pairs at 1-based lines ``blank`` skipped for an empty side."""
    return (f"{where}: skipped {len(blank)} of {num_pairs} pairs with an empty side (lines "
            f"{first_lines(blank)})")


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> list[tuple[str, str]]:
    """(source, target) pairs of two line-aligned files, e.g. newstest2014.en/.de.

    Same normalisation and errors as `TextSource`; pairs with an empty side are skipped (a warning
    gives their count and lines).
    """
    return read_parallel_numbered(src_path, tgt_path)[0]


def read_parallel_numbered(
    src_path: str | Path, tgt_path: str | Path
) -> tuple[list[tuple[str, str]], list[int]]:
    """`read_parallel`'s pairs and the 1-based line number of each (for messages naming a line)."""
    pairs, lines, _ = _read_parallel(Path(src_path), Path(tgt_path), split="given")
    return pairs, lines


def input_files(data_config: Any, splits: Sequence[str] = SPLITS) -> list[tuple[str, Path]]:
    """(what, path) of every file or folder that reading `splits` of `data_config` needs.

    `what` names the config fields that give the path. Synthetic sources read no files; TFDS
    prepares its own (only the folder is checked, when set).
    """
    source = data_config.source
    if source == "text":
        fields = {"train": "train_prefix", "dev": "dev_prefix", "test": "test_prefix"}
        found = []
        for split in splits:
            prefix = getattr(data_config, fields[split])
            for lang in ("src_lang", "tgt_lang"):
                path = Path(data_config.dir) / f"{prefix}.{getattr(data_config, lang)}"
                found.append((f"the {split} split (config.data.dir, .{fields[split]}, .{lang})", path))
        return found
    if source == "ptb":
        return [("the treebank folder (data.dir)", Path(data_config.dir))]
    return []


def check_input_files(data_config: Any, splits: Sequence[str] = SPLITS) -> None:
    """Raises MissingFileError naming the first missing input file and the config fields behind it."""
    validate_data_config(data_config)
    folder = getattr(data_config, "dir", None)
    if folder and os.path.isfile(folder):
        raise MissingFileError(f"data.dir={folder} is a file; expected the folder that holds the data "
                               "files. Point data.dir at its folder")
    for what, path in input_files(data_config, splits):
        if not path.exists():
            raise MissingFileError(
                f"{path}: no such file or folder; it holds {what}. Fix the data.* fields or create it"
                + (" (python -m transformer_jax.data.prepare --help)" if data_config.source == "text"
                   else ""))
        if data_config.source == "text" and path.is_dir():
            raise DataError(f"{path} is a folder; expected a file of {what}, one sentence per line. Fix "
                            "the data.* fields or put the file there")


# ----------------------------------------------------------------------------- TFDS

class NotPreparedError(UserError, RuntimeError):
    """A TFDS dataset is not prepared and cannot be downloaded here; the message says how to prepare it."""


# WMT downloads come from statmt.org; probing it tells us quickly whether we are offline.
_PROBE_HOST = ("www.statmt.org", 443)
_PROBE_TIMEOUT_S = 3.0


def is_online(host: tuple[str, int] = _PROBE_HOST, timeout_s: float = _PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to `host` succeeds within `timeout_s` (DNS included)."""
    result = [False]

    def probe() -> None:
        try:
            with socket.create_connection(host, timeout=timeout_s):
                result[0] = True
        except OSError:
            pass

    # A thread bounds the DNS lookup too, which socket timeouts do not cover.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0]


class TfdsPairs(Sequence):
    """Lazy (source, target) view of a TFDS ArrayRecord data source; int and slice indexing."""

    def __init__(self, data_source: Any, src_lang: str, tgt_lang: str):
        self._ds = data_source
        self._src, self._tgt = src_lang, tgt_lang

    def __len__(self) -> int:
        return len(self._ds)

    def _pair(self, example: dict[str, Any]) -> tuple[str, str]:
        src, tgt = example[self._src], example[self._tgt]
        src = src.decode("utf-8") if isinstance(src, bytes) else str(src)
        tgt = tgt.decode("utf-8") if isinstance(tgt, bytes) else str(tgt)
        return normalize_whitespace(src), normalize_whitespace(tgt)

    @overload
    def __getitem__(self, index: int) -> tuple[str, str]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, str]]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            indices = list(range(*index.indices(len(self))))
            return [self._pair(e) for e in self._ds.__getitems__(indices)] if indices else []
        return self._pair(self._ds[index])


class TfdsSource:
    """A TFDS translation dataset read through ArrayRecord, without TensorFlow.

    `name` is any registered builder (e.g. 'wmt14_translate/de-en'); `src_lang`/`tgt_lang` pick
    its feature keys, so either direction works. If the data is not prepared in `data_dir`,
    it is downloaded and prepared (file_format='array_record') only when the download host
    answers within seconds; offline, a NotPreparedError (one line) explains how to prepare it elsewhere.
    Dev and test pairs with an empty side are skipped (`num_skipped`); 'train' is lazy
    (`TfdsPairs`) and the batching code drops empty pairs.
    """

    def __init__(
        self,
        name: str,
        *,
        data_dir: str | None,
        src_lang: str,
        tgt_lang: str,
        split_names: dict[str, str],
    ):
        self.name = name
        self.data_dir = data_dir or None
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        self.split_names = split_names
        self.num_skipped: dict[str, int] = {}
        self._builder: Any = None
        self._cache: dict[str, Sequence[tuple[str, str]]] = {}

    def prepared_builder(self) -> Any:
        if self._builder is not None:
            return self._builder
        # tensorflow_datasets is heavy and only the tfds source needs it: imported on first use.
        import tensorflow_datasets as tfds
        import tensorflow_datasets.translate  # noqa: F401  (registers wmt14_translate & co.)

        builder = tfds.builder(self.name, data_dir=self.data_dir)
        if not builder.is_prepared():
            if not is_online():
                raise NotPreparedError(self._offline_message(builder.data_dir))
            logging.info("Preparing %s in %s (array_record)", self.name, builder.data_dir)
            builder.download_and_prepare(file_format="array_record")
        self._builder = builder
        return builder

    def _offline_message(self, where: str) -> str:
        data_dir = self.data_dir or "~/tensorflow_datasets"
        return (
            f"TFDS dataset {self.name!r} is not prepared in {where} and {_PROBE_HOST[0]} is not"
            f" reachable (no network?), so it cannot be downloaded here. On a machine with"
            f" internet run:\n  python -c \"import tensorflow_datasets as tfds,"
            f" tensorflow_datasets.translate; tfds.builder('{self.name}',"
            f" data_dir='{data_dir}').download_and_prepare(file_format='array_record')\"\n"
            f"then copy {data_dir} here, or set data_config.tfds_data_dir to a folder that holds"
            f" the prepared dataset (array_record format)."
        )

    def pairs(self, split: str) -> Sequence[tuple[str, str]]:
        _check_split(split)
        if split in self._cache:
            return self._cache[split]
        builder = self.prepared_builder()
        features = set(builder.info.features.keys())
        for lang in (self.src_lang, self.tgt_lang):
            if lang not in features:
                raise ValueError(
                    f"TFDS dataset {self.name!r} has no language {lang!r}; its features are"
                    f" {sorted(features)} (check data_config.src_lang / tgt_lang)"
                )
        tfds_split = self.split_names[split]
        if tfds_split not in builder.info.splits:
            raise ValueError(
                f"TFDS dataset {self.name!r} has no split {tfds_split!r}; it has"
                f" {sorted(builder.info.splits)}"
            )
        view = TfdsPairs(
            builder.as_data_source(split=tfds_split, file_format="array_record"),
            self.src_lang,
            self.tgt_lang,
        )
        if split == "train":
            result: Sequence[tuple[str, str]] = view
        else:
            everything = view[:]
            result = [(s, t) for s, t in everything if s and t]
            self.num_skipped[split] = len(everything) - len(result)
            if self.num_skipped[split]:
                logging.warning(
                    "%s %s: skipped %d pairs with an empty side",
                    self.name,
                    tfds_split,
                    self.num_skipped[split],
                )
        self._cache[split] = result
        return result


# ----------------------------------------------------------------------------- factory


def get_source(data_config: Any) -> Source:
    """The source named by `data_config.source` (validated first).

    Parsing sources ('ptb', 'synthetic_trees') are `TreebankSource`s: they also have `trees(split)`.
    """
    validate_data_config(data_config)
    if data_config.source in PARSING_SOURCES:
        return TreebankSource.from_config(data_config)
    if data_config.source == "synthetic":
        return SyntheticSource(
            train_size=data_config.synthetic_train_size,
            dev_size=data_config.synthetic_dev_size,
            test_size=data_config.synthetic_test_size,
            seed=data_config.synthetic_seed,
            min_words=getattr(data_config, "synthetic_min_words", 3),
            max_words=getattr(data_config, "synthetic_max_words", 40),
            test_min_words=getattr(data_config, "synthetic_test_min_words", 0),
        )
    if data_config.source == "text":
        return TextSource(
            data_config.dir,
            {
                "train": data_config.train_prefix,
                "dev": data_config.dev_prefix,
                "test": data_config.test_prefix,
            },
            data_config.src_lang,
            data_config.tgt_lang,
        )
    return TfdsSource(
        data_config.tfds_name,
        data_dir=data_config.tfds_data_dir,
        src_lang=data_config.src_lang,
        tgt_lang=data_config.tgt_lang,
        split_names={
            "train": "train",
            "dev": data_config.tfds_dev_split,
            "test": data_config.tfds_test_split,
        },
    )
