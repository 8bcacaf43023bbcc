"""A corpus's train split as the data cache reads it: by row ranges, from any process, never whole.

``TextCorpus`` reads two line-aligned files by byte ranges found once (``line_starts``), with the same
normalisation and errors as ``sources.TextSource``; ``TfdsCorpus`` reads a prepared TFDS dataset from its
folder, so a worker process needs no registered builder. ``open_corpus`` names a data config's corpus
and decides how many worker processes a build of it takes (``processes``: none for a small corpus).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax.data import disk_cache
from transformer_jax.data.sources import TfdsPairs, get_source, normalize_whitespace, suspicious_lines
from transformer_jax.runtime.errors import DataError, MissingFileError

SMALL_BYTES = 32 << 20  # a text corpus smaller than this is built in the process that needs it
SMALL_PAIRS = 100_000  # likewise a TFDS split with fewer pairs
_INDEX_BLOCK = 1 << 24  # bytes read at a time while finding line starts
_opened: dict[str, Sequence[tuple[str, str]]] = {}  # TFDS folder -> its train pairs, in this process


def worker_count() -> int:
    """Worker processes for a build: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def line_starts(path: Path) -> np.ndarray:
    """int64[num_lines + 1]: the byte offset where each line of ``path`` starts, then the file's size.

    Lines are split at b'\\n' only, as ``sources.read_lines`` splits them; a final newline ends the
    last line rather than starting an empty one.
    """
    parts = [np.zeros(1, np.int64)]
    with open(path, "rb") as f:
        position = 0
        while block := f.read(_INDEX_BLOCK):
            parts.append(np.flatnonzero(np.frombuffer(block, np.uint8) == 10).astype(np.int64) + position + 1)
            position += len(block)
    starts = np.concatenate(parts)
    return starts if starts[-1] == position else np.append(starts, position)


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """Two line-aligned files read by row ranges; pairs with an empty side are skipped (as ``TextSource``).

    ``indexed()`` finds the lines (``src_starts``, ``tgt_starts``: ``line_starts``), which only a build needs.
    """

    src_path: Path
    tgt_path: Path
    processes: int = 0  # worker processes of a build; 0: build in the calling process
    src_starts: np.ndarray | None = None
    tgt_starts: np.ndarray | None = None
    hashes: Path | None = None  # where the files' SHA-256 are kept (``disk_cache.file_sha256``'s index)
    skips_blank = True

    def indexed(self) -> TextCorpus:
        """This corpus with its lines found; DataError if a file is empty or the line counts differ."""
        for path, other in ((self.src_path, self.tgt_path), (self.tgt_path, self.src_path)):
            expected = f"expected the train split, one sentence per line, line-aligned with {other}"
            if not path.is_file():
                raise MissingFileError(f"{path}: no such file; {expected}")
            if path.stat().st_size == 0:
                raise DataError(f"{path}: file is empty; {expected}")
        src_starts, tgt_starts = line_starts(self.src_path), line_starts(self.tgt_path)
        if len(src_starts) != len(tgt_starts):
            raise DataError(f"line counts differ: {self.src_path} has {len(src_starts) - 1} lines, "
                            f"{self.tgt_path} has {len(tgt_starts) - 1} lines; the files must be "
                            "line-aligned")
        return dataclasses.replace(self, src_starts=src_starts, tgt_starts=tgt_starts)

    @property
    def num_rows(self) -> int:
        return len(self.src_starts) - 1

    def describe(self) -> str:
        return f"{self.src_path} / {self.tgt_path}"

    def files(self) -> list[Path]:
        """The files a build reads."""
        return [self.src_path, self.tgt_path]

    def fingerprint(self) -> dict[str, Any]:
        return {"source": "text", "src_sha256": disk_cache.file_sha256(self.src_path, index=self.hashes),
                "tgt_sha256": disk_cache.file_sha256(self.tgt_path, index=self.hashes)}

    def _lines(self, path: Path, starts: np.ndarray, start: int, stop: int) -> list[str]:
        with open(path, "rb") as f:
            f.seek(int(starts[start]))
            data = f.read(int(starts[stop] - starts[start]))
        try:
            text = data.decode("utf-8-sig" if start == 0 else "utf-8")  # a byte-order mark is not text
        except UnicodeDecodeError as e:
            line = start + data.count(b"\n", 0, e.start) + 1
            raise DataError(f"{path}:{line}: invalid UTF-8 ({e.reason} at byte {starts[start] + e.start}); "
                            "expected the train split, one sentence per line") from None
        lines = text.split("\n")  # not splitlines(): U+2028, U+0085 etc. are characters of a line
        if len(lines) > stop - start:
            lines.pop()  # the final newline's empty remainder
        return lines

    def read(self, start: int, stop: int) -> tuple[list[str], list[str], dict[str, list[int]]]:
        """Rows [start, stop), normalised: (sources, targets, {'nul_src': [1-based lines], ...})."""
        src = self._lines(self.src_path, self.src_starts, start, stop)
        tgt = self._lines(self.tgt_path, self.tgt_starts, start, stop)
        found = {f"{kind}_{side}": numbers for side, lines in (("src", src), ("tgt", tgt))
                 for kind, numbers in suspicious_lines(lines, first=start + 1).items()}
        return [normalize_whitespace(s) for s in src], [normalize_whitespace(t) for t in tgt], found


@dataclasses.dataclass(frozen=True)
class TfdsCorpus:
    """A prepared TFDS translation dataset's train split, read by index ranges from its folder (a worker
    needs no registered builder); empty sides are dropped at encoding, as ``tokenize_pairs`` drops them."""

    name: str
    builder_dir: str  # the prepared dataset's versioned folder, e.g. .../wmt14_translate/de-en/1.0.0
    src_lang: str
    tgt_lang: str
    num_rows: int
    processes: int = 0  # worker processes of a build; 0: build in the calling process
    skips_blank = False

    @classmethod
    def open(cls, data_config: Any) -> TfdsCorpus:
        source = get_source(data_config)
        num_rows = len(source.pairs("train"))  # checks the languages and the split first
        builder = source.prepared_builder()
        return cls(data_config.tfds_name, str(builder.data_dir), data_config.src_lang, data_config.tgt_lang,
                   num_rows, 0 if num_rows < SMALL_PAIRS else worker_count())

    def indexed(self) -> TfdsCorpus:
        return self

    def describe(self) -> str:
        return f"TFDS {self.name} train ({self.builder_dir})"

    def files(self) -> list[str]:
        """The files a build reads: the train split's."""
        import tensorflow_datasets as tfds

        return sorted(tfds.builder_from_directory(self.builder_dir).info.splits["train"].filepaths)

    def fingerprint(self) -> dict[str, Any]:
        import tensorflow_datasets as tfds

        info = tfds.builder_from_directory(self.builder_dir).info
        files = sorted((os.path.basename(f), os.path.getsize(f)) for f in info.splits["train"].filepaths)
        return {"source": "tfds", "name": info.full_name, "num_rows": self.num_rows, "files": files}

    def read(self, start: int, stop: int) -> tuple[list[str], list[str], dict[str, list[int]]]:
        if self.builder_dir not in _opened:  # once per process
            import tensorflow_datasets as tfds

            builder = tfds.builder_from_directory(self.builder_dir)
            source = builder.as_data_source(split="train", file_format="array_record")
            _opened[self.builder_dir] = TfdsPairs(source, self.src_lang, self.tgt_lang)
        pairs = _opened[self.builder_dir][start:stop]
        return [s for s, _ in pairs], [t for _, t in pairs], {}


def open_corpus(data_config: Any) -> TextCorpus | TfdsCorpus:
    """The train split of a cached source, named but not read (``indexed()`` reads it). One under
    ``SMALL_BYTES`` of text or ``SMALL_PAIRS`` pairs is built in the calling process, any other by
    ``worker_count()`` processes."""
    if data_config.source == "text":
        src_path, tgt_path = get_source(data_config).paths("train")
        size = sum(path.stat().st_size for path in (src_path, tgt_path) if path.is_file())
        return TextCorpus(src_path, tgt_path, 0 if size < SMALL_BYTES else worker_count(),
                          hashes=disk_cache.cache_root(data_config.cache_dir) / disk_cache.HASHES)
    return TfdsCorpus.open(data_config)
