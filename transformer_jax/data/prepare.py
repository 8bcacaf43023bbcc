"""Download a data set's raw files into a folder, checked and ready for the text source.

    python -m transformer_jax.data.prepare multi30k --dir=data/multi30k
    python train.py --config=configs/multi30k.py --config.data.dir=data/multi30k
    python -m transformer_jax.data.prepare ptb_sample --dir=data/ptb_sample
    python train.py --config=configs/ptb_sample.py --config.data.dir=data/ptb_sample

A config's data cache is built ahead of training by ``python -m transformer_jax.prepare_cache
--config=...``: it reads a run config, so it lives above ``data/``, with the other entry points.

``multi30k`` fetches Multi30k task 1 (train, val, test2016; English and German) from the dataset's public
GitHub repository, the gzipped raw files under ``MULTI30K_BASE_URL``, and installs ``train.{en,de}``,
``val.{en,de}`` and ``test.{en,de}`` (test = test_2016_flickr), each checked against a SHA-256 carried
in this module.

``ptb_sample`` fetches NLTK's sample of the Penn Treebank (``treebank.zip`` from the nltk_data
repository, ``PTB_SAMPLE_BASE_URL``) and installs its ``treebank/combined/wsj_0001.mrg .. wsj_0199.mrg``
flat in the folder. What is checked is the SHA-256 of the 199 extracted files concatenated in name order,
``PTB_SAMPLE_ZIP.sha256``, before any is installed (not the zip's own hash: any zip holding these files
passes). Its terms of use (``TERMS``) are printed on every run.

For each file (a gzip, or a zip and the files extracted from it):
- installed files whose SHA-256 is right are left alone, so a rerun touches nothing (and needs no network);
- the download goes to ``<name>.gz.part`` (``<name>.zip.part``) in the folder. After an interruption, the
  next run resumes it with an HTTP Range request, or restarts it when the server answers with the whole
  file. A resumed ``.part`` that then fails the check is deleted and downloaded again from scratch, once;
- a ``<name>.gz`` (``<name>.zip``) put into the folder by hand is used instead of downloading;
- the decompressed bytes are hashed while written to temporary files in the folder, which are fsynced and
  renamed onto the installed names (``os.replace``) only when the hash is right. A wrong hash is an error
  that names the file and both hashes, and nothing is installed.
Network errors fail fast (``--timeout`` seconds per connection or read, no retries) with a line that says
which files to put where by hand. HTTP is the standard library's ``urllib``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import re
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

from absl import flags

from transformer_jax.runtime import errors

_CHUNK = 1 << 16  # bytes per read and write


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """One gzipped file to fetch and the file it installs."""

    remote: str  # file name under the base URL, e.g. "test_2016_flickr.de.gz"
    local: str  # installed name in the folder, e.g. "test.de"
    sha256: str  # of the decompressed file, hex

    @property
    def locals(self) -> tuple[str, ...]:
        return (self.local,)


@dataclasses.dataclass(frozen=True)
class RemoteZip:
    """One zip to fetch and the files of one of its folders that it installs (flat, under their names)."""

    remote: str  # file name under the base URL, e.g. "treebank.zip"
    folder: str  # the folder inside the zip, e.g. "treebank/combined/"
    locals: tuple[str, ...]  # the files of ``folder`` to install, in the order ``sha256`` hashes them
    sha256: str  # of those files' bytes concatenated in that order, hex (not of the zip itself)


MULTI30K_BASE_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/"
# The files as in the dataset's repository since its commit c9be912 (2018-01-17).
MULTI30K_FILES = (
    RemoteFile("train.en.gz", "train.en", "460a15fbd157e34a7a9957ee388c1ca247fe47af3ef25fb50442af6c274e0fc6"),
    RemoteFile("train.de.gz", "train.de", "2c2b73fd2b548fbcde3a875e0a78d6ee94d498bfdee6bd3eae3945779e9ddf72"),
    RemoteFile("val.en.gz", "val.en", "1f2a23d992769b5b3d209b0a10dd0b77c08cceb1f20dfb97ed0aafa49d107227"),
    RemoteFile("val.de.gz", "val.de", "660e09eb7e1da2f856ea13ee5ad3cf6d36b3d5b0b733c857e94c5747a3dfc660"),
    RemoteFile("test_2016_flickr.en.gz", "test.en",
               "399a4382932c1aadd3ceb9bef1008d388a64c76d4ae4e9d4728c6f4301cac182"),
    RemoteFile("test_2016_flickr.de.gz", "test.de",
               "4be6b5b3236b79c25475c6bb829800a7ce559e9ba7a1f6c2394fe4d40be46d16"),
)

PTB_SAMPLE_BASE_URL = "https://raw.githubusercontent.com/nltk/nltk_data/gh-pages/packages/corpora/"
# The hash of the 199 files (3,914 trees) concatenated in name order, as copied unchanged from
# nltk_data's treebank.zip at its commit 5db857e. The zip's own hash is not pinned: it could not be
# downloaded when this was written, and any zip that holds these files passes.
PTB_SAMPLE_ZIP = RemoteZip(
    "treebank.zip", "treebank/combined/", tuple(f"wsj_{i:04d}.mrg" for i in range(1, 200)),
    "f018900543fbff4571439fd5e5ebdae00ba53dfdd6543e48491230d76d0e06a1")

DATASETS = {"multi30k": (MULTI30K_BASE_URL, MULTI30K_FILES),
            "ptb_sample": (PTB_SAMPLE_BASE_URL, (PTB_SAMPLE_ZIP,))}
COMMANDS = tuple(DATASETS)  # the positional argument: a data set to download
CACHE_COMMAND = "python -m transformer_jax.prepare_cache --config=CONFIG"  # the data cache's, above data/
# Printed by ``prepare``: the terms the data set's own README states.
TERMS = {"ptb_sample": "(C) LDC 1995. It is made available under fair use for the purposes of illustrating "
                       "NLTK tools for tokenizing, tagging, chunking and parsing. This data is for "
                       "non-commercial use only."}


class DownloadError(OSError):
    """The server was unreachable (``unreachable``) or a transfer broke off; the message says what to do."""

    def __init__(self, message: str, *, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


class ChecksumError(ValueError):
    """A file's SHA-256 is not the expected one; the message names the file and both hashes."""


class _Corrupt(Exception):
    """A gzip that does not decompress or hashes wrong (raised as ChecksumError at the top)."""


def prepare(name: str, directory: str | os.PathLike, *, base_url: str | None = None,
            timeout: float = 10.0, log: Callable[[str], None] = print) -> list[Path]:
    """Installs data set ``name`` (a key of ``DATASETS``) into ``directory``; returns the installed paths."""
    if name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose from {sorted(DATASETS)}")
    default_url, files = DATASETS[name]
    if name in TERMS:
        log(f"{name}: terms of use, as its README states them: {TERMS[name]}")
    return fetch_files(files, directory, base_url=base_url or default_url, timeout=timeout, log=log)


def fetch_files(files: Sequence[RemoteFile | RemoteZip], directory: str | os.PathLike, *, base_url: str,
                timeout: float = 10.0, log: Callable[[str], None] = print) -> list[Path]:
    """Downloads, checks and installs ``files`` (see the module docstring); returns the installed paths.

    Raises:
      DownloadError: the server is unreachable or a transfer was cut short (rerun to resume).
      ChecksumError: a file's decompressed SHA-256 differs from ``RemoteFile.sha256`` (or the extracted
        files' from ``RemoteZip.sha256``), or a zip lacks one of the files to install.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    base_url = base_url if base_url.endswith("/") else base_url + "/"
    installed = []
    for file in files:
        dests = [folder / name for name in file.locals]
        if all(dest.is_file() for dest in dests):
            found = _sha256_of(*dests)
            if found == file.sha256:
                log(f"{_label(file, folder)}: present, sha256 ok")
                installed.extend(dests)
                continue
            log(f"{_label(file, folder)}: present but sha256 {found} != expected {file.sha256}; fetching "
                "again")
        try:
            _fetch_one(file, folder, base_url, timeout, log)
        except DownloadError as e:
            if not e.unreachable:
                raise
            raise DownloadError(f"{e}. {_by_hand(files, folder, base_url)}", unreachable=True) from e
        installed.extend(dests)
    return installed


def _label(file: RemoteFile | RemoteZip, folder: Path) -> str:
    """How logs and errors name what ``file`` installs: ``d/test.de``, ``d/wsj_0001.mrg .. wsj_0199.mrg``."""
    names = file.locals[0] if len(file.locals) == 1 else f"{file.locals[0]} .. {file.locals[-1]}"
    return str(folder / names)


def _fetch_one(file: RemoteFile | RemoteZip, folder: Path, base_url: str, timeout: float,
               log: Callable[[str], None]) -> None:
    label, url = _label(file, folder), base_url + file.remote
    what = Path(label).name
    by_hand = folder / file.remote
    if by_hand.is_file():  # a gzip or zip the user put there; never deleted by us
        try:
            _install(by_hand, file, folder)
        except _Corrupt as e:
            raise ChecksumError(
                f"{by_hand}: {e}; {what} not installed (delete {by_hand} and rerun)") from e
        log(f"{label}: installed from {by_hand}, sha256 ok")
        return
    part = folder / (file.remote + ".part")
    resumed = _download(url, part, timeout, log)
    try:
        _install(part, file, folder)
    except _Corrupt as e:
        part.unlink()
        if not resumed:
            raise ChecksumError(f"{url}: {e}; {what} not installed") from e
        log(f"{part}: the resumed download failed its check ({e}); downloading it again")
        _download(url, part, timeout, log)
        try:
            _install(part, file, folder)
        except _Corrupt as e2:
            part.unlink()
            raise ChecksumError(f"{url}: {e2}; {what} not installed") from e2
    part.unlink()
    log(f"{label}: downloaded from {url}, sha256 ok")


def _download(url: str, part: Path, timeout: float, log: Callable[[str], None]) -> bool:
    """Completes ``part`` from ``url``; returns whether it kept bytes from an earlier run."""
    have = part.stat().st_size if part.is_file() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to send: the .part is complete (or corrupt)
            return True
        raise DownloadError(f"cannot download {url}: HTTP {e.code} {e.reason}", unreachable=True) from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise DownloadError(f"cannot reach {url} ({reason})", unreachable=True) from e
    with response:
        resuming = bool(have) and response.status == 206 and _range_start(response) == have
        if response.status == 206 and not resuming:  # a range we did not ask for: start over next time
            part.unlink(missing_ok=True)
            got = response.headers.get("Content-Range")
            raise DownloadError(f"{url} answered with bytes {got} instead of from byte {have}; deleted "
                                f"{part}, rerun to download it again")
        if have and not resuming:
            log(f"{part}: the server does not resume at byte {have}; restarting the download")
        expected = response.headers.get("Content-Length")
        received = 0
        with open(part, "ab" if resuming else "wb") as out:
            try:
                while chunk := response.read(_CHUNK):
                    out.write(chunk)
                    received += len(chunk)
            except OSError as e:  # a timeout or reset mid-transfer; what arrived stays in .part
                raise DownloadError(f"download of {url} broke off after {received} bytes ({e}); rerun to "
                                    f"resume from {part}") from e
    if expected is not None and received < int(expected):
        raise DownloadError(f"download of {url} broke off after {received} of {expected} bytes; rerun to "
                            f"resume from {part}")
    return resuming


def _range_start(response) -> int | None:
    match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
    return int(match.group(1)) if match else None


def _install(path: Path, file: RemoteFile | RemoteZip, folder: Path) -> None:
    if isinstance(file, RemoteZip):
        _install_zip(path, file, folder)
    else:
        _install_gz(path, file, folder / file.local)


def _install_gz(gz_path: Path, file: RemoteFile, dest: Path) -> None:
    """Decompresses ``gz_path`` to a temp file beside ``dest``, checks its hash, renames it onto ``dest``."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with gzip.open(gz_path, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
            except (gzip.BadGzipFile, EOFError, zlib.error) as e:
                raise _Corrupt(f"not a complete gzip file ({e})") from e
            if digest.hexdigest() != file.sha256:
                raise _Corrupt(f"sha256 of the decompressed {dest.name} is {digest.hexdigest()}, expected "
                               f"{file.sha256}")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp_name, dest)
        _fsync_dir(dest.parent)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def _install_zip(zip_path: Path, file: RemoteZip, folder: Path) -> None:
    """Extracts ``file.locals`` from ``file.folder`` of ``zip_path`` to temp files in ``folder``, checks the
    hash of their concatenation, then renames each onto its name (all or, when the hash is wrong, none)."""
    digest, temps = hashlib.sha256(), []
    try:
        try:
            with zipfile.ZipFile(zip_path) as archive:
                present = set(archive.namelist())
                missing = [name for name in file.locals if file.folder + name not in present]
                if missing:
                    raise _Corrupt(f"{len(missing)} of the {len(file.locals)} files to install are not in "
                                   f"its folder {file.folder}, e.g. {missing[0]}")
                for name in file.locals:
                    fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
                    temps.append((tmp_name, folder / name))
                    with os.fdopen(fd, "wb") as out, archive.open(file.folder + name) as src:
                        while chunk := src.read(_CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
                        out.flush()
                        os.fsync(out.fileno())
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:
            raise _Corrupt(f"not a complete zip file ({e})") from e
        if digest.hexdigest() != file.sha256:
            raise _Corrupt(f"sha256 of the extracted {_label(file, Path())} concatenated in name order is "
                           f"{digest.hexdigest()}, expected {file.sha256}")
        for tmp_name, dest in temps:
            os.replace(tmp_name, dest)
        _fsync_dir(folder)
    finally:
        for tmp_name, _ in temps:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)


def _fsync_dir(folder: Path) -> None:
    if os.name == "posix":  # makes the rename durable; directories cannot be opened on Windows
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sha256_of(*paths: Path) -> str:
    """SHA-256 of the files' bytes concatenated in the given order."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def _by_hand(files: Sequence[RemoteFile | RemoteZip], folder: Path, base_url: str) -> str:
    names = ", ".join(f.remote for f in files)
    return f"To install by hand, download {names} from {base_url} into {folder}/ and run this command again."


# ------------------------------------------------------------------------------------------------ CLI

_DIR = flags.DEFINE_string("dir", None, "Folder to install the files into (created if missing); pass it to "
                           "train.py as --config.data.dir.")
_BASE_URL = flags.DEFINE_string("base_url", None, "Where to download from, a URL ending in the folder of the "
                                "gzipped files or the zip (default: the data set's public repository, e.g. "
                                f"{MULTI30K_BASE_URL} for multi30k).")
_TIMEOUT = flags.DEFINE_float("timeout", 10.0, "Seconds to wait for a connection or for each read before "
                              "giving up (no retries; rerun to resume).")


def main(argv: Sequence[str]) -> None:
    usage = (f"usage: python -m transformer_jax.data.prepare {{{','.join(sorted(DATASETS))}}} --dir=DIR; a "
             f"config's data cache: {CACHE_COMMAND}")
    if len(argv) != 2:
        raise errors.ConfigError(f"expected one data set name, got {list(argv[1:]) or 'none'}; {usage}")
    if not _DIR.value:
        raise errors.ConfigError(f"--dir is required: the folder to install the files into; {usage}")
    try:
        paths = prepare(argv[1], _DIR.value, base_url=_BASE_URL.value, timeout=_TIMEOUT.value)
    except (ValueError, OSError) as e:  # ChecksumError, DownloadError, an unwritable folder, ...
        raise errors.UserError(f"prepare {argv[1]}: {e}") from e
    print(f"{len(paths)} files ready in {_DIR.value}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["cache"]:  # before the flags are parsed: --config is not one of this command's
        errors.print_error(f"the data cache is built by its own command now: {CACHE_COMMAND} (the same "
                           "flags as before)")
    errors.run_main(main, takes_args=True)  # the data set name
