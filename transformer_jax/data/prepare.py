"""Download a data set's raw files into a folder, checked and ready for the text source.

    python -m transformer_jax.data.prepare multi30k --dir=data/multi30k
    python train.py --config=configs/multi30k.py --config.data.dir=data/multi30k

``multi30k`` fetches Multi30k task 1 (train, val, test2016; English and German) from the dataset's public
GitHub repository, the gzipped raw files under ``MULTI30K_BASE_URL``, and installs ``train.{en,de}``,
``val.{en,de}`` and ``test.{en,de}`` (test = test_2016_flickr), each checked against a SHA-256 carried
in this module.

For each file:
- an installed file whose SHA-256 is right is left alone, so a rerun touches nothing (and needs no network);
- the download goes to ``<name>.gz.part`` in the folder. After an interruption, the next run resumes it with
  an HTTP Range request, or restarts it when the server answers with the whole file. A resumed ``.part``
  that then fails the check is deleted and downloaded again from scratch, once;
- a ``<name>.gz`` put into the folder by hand is used instead of downloading;
- the decompressed bytes are hashed while written to a temporary file in the folder, which is fsynced and
  renamed onto ``{prefix}.{lang}`` (``os.replace``) only when the hash is right. A wrong hash is an error
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


MULTI30K_BASE_URL = "https://github.com/multi30k/dataset/raw/master/data/task1/raw/"
# From ../shared/data/SOURCES.md: the files as in the repository since commit c9be912 (2018-01-17).
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
DATASETS = {"multi30k": (MULTI30K_BASE_URL, MULTI30K_FILES)}


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
    return fetch_files(files, directory, base_url=base_url or default_url, timeout=timeout, log=log)


def fetch_files(files: Sequence[RemoteFile], directory: str | os.PathLike, *, base_url: str,
                timeout: float = 10.0, log: Callable[[str], None] = print) -> list[Path]:
    """Downloads, checks and installs ``files`` (see the module docstring); returns the installed paths.

    Raises:
      DownloadError: the server is unreachable or a transfer was cut short (rerun to resume).
      ChecksumError: a file's decompressed SHA-256 differs from ``RemoteFile.sha256``.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    base_url = base_url if base_url.endswith("/") else base_url + "/"
    installed = []
    for file in files:
        dest = folder / file.local
        if dest.is_file():
            found = _sha256_of(dest)
            if found == file.sha256:
                log(f"{dest}: present, sha256 ok")
                installed.append(dest)
                continue
            log(f"{dest}: present but sha256 {found} != expected {file.sha256}; fetching it again")
        try:
            _fetch_one(file, folder, base_url, timeout, log)
        except DownloadError as e:
            if not e.unreachable:
                raise
            raise DownloadError(f"{e}. {_by_hand(files, folder, base_url)}", unreachable=True) from e
        installed.append(dest)
    return installed


def _fetch_one(file: RemoteFile, folder: Path, base_url: str, timeout: float,
               log: Callable[[str], None]) -> None:
    dest, url = folder / file.local, base_url + file.remote
    by_hand = folder / file.remote
    if by_hand.is_file():  # a gzip the user put there; never deleted by us
        try:
            _install(by_hand, file, dest)
        except _Corrupt as e:
            raise ChecksumError(
                f"{by_hand}: {e}; {dest.name} not installed (delete {by_hand} and rerun)") from e
        log(f"{dest}: installed from {by_hand}, sha256 ok")
        return
    part = folder / (file.remote + ".part")
    resumed = _download(url, part, timeout, log)
    try:
        _install(part, file, dest)
    except _Corrupt as e:
        part.unlink()
        if not resumed:
            raise ChecksumError(f"{url}: {e}; {dest.name} not installed") from e
        log(f"{part}: the resumed download failed its check ({e}); downloading it again")
        _download(url, part, timeout, log)
        try:
            _install(part, file, dest)
        except _Corrupt as e2:
            part.unlink()
            raise ChecksumError(f"{url}: {e2}; {dest.name} not installed") from e2
    part.unlink()
    log(f"{dest}: downloaded from {url}, sha256 ok")


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


def _install(gz_path: Path, file: RemoteFile, dest: Path) -> None:
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


def _fsync_dir(folder: Path) -> None:
    if os.name == "posix":  # makes the rename durable; directories cannot be opened on Windows
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _by_hand(files: Sequence[RemoteFile], folder: Path, base_url: str) -> str:
    names = ", ".join(f.remote for f in files)
    return f"To install by hand, download {names} from {base_url} into {folder}/ and run this command again."


# ------------------------------------------------------------------------------------------------ CLI

_DIR = flags.DEFINE_string("dir", None, "Folder to install the files into (created if missing); pass it to "
                           "train.py as --config.data.dir.")
_BASE_URL = flags.DEFINE_string("base_url", None, "Where to download from, a URL ending in the folder of the "
                                "gzipped files (default: the data set's public repository, e.g. "
                                f"{MULTI30K_BASE_URL} for multi30k).")
_TIMEOUT = flags.DEFINE_float("timeout", 10.0, "Seconds to wait for a connection or for each read before "
                              "giving up (no retries; rerun to resume).")


def main(argv: Sequence[str]) -> None:
    usage = f"usage: python -m transformer_jax.data.prepare {{{','.join(sorted(DATASETS))}}} --dir=DIR"
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
    errors.run_main(main, positional=True)
