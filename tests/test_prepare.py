"""Tests for transformer_jax.data.prepare against a local HTTP server on 127.0.0.1 (no internet needed)."""

import dataclasses
import gzip
import hashlib
import http.server
import io
import re
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from transformer_jax.data import prepare

REPO = Path(__file__).resolve().parents[1]
SHARED_MULTI30K = REPO.parent / "shared" / "data" / "multi30k"
SHARED_PTB_SAMPLE = REPO.parent / "shared" / "data" / "ptb_sample"


def _text(n_lines: int, seed: int) -> bytes:
    # Non-ASCII and a bit of variety, so the gzip is a few KB and a half of it is not a valid gzip.
    return "".join(f"Zeile {i} für {seed}: {i * i * seed % 9973} Grüße\n" for i in range(n_lines)).encode()


PLAIN = {"a.en": _text(301, 3), "a.de": _text(307, 5), "b.de": _text(997, 7)}
GZ = {name + ".gz": gzip.compress(data, mtime=0) for name, data in PLAIN.items()}
FILES = tuple(prepare.RemoteFile(name + ".gz", name, hashlib.sha256(data).hexdigest())
              for name, data in PLAIN.items())


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves ``server.files`` under /data/, with Range support unless ``server.ranges`` is False; cuts the
    body of each name in ``server.truncate`` to half (once) after announcing the full Content-Length."""

    def do_GET(self):
        srv = self.server
        name = self.path.removeprefix("/data/")
        header = self.headers.get("Range")
        srv.requests.append((name, header))
        body = srv.files.get(name)
        if body is None:
            self.send_error(404)
            return
        start = int(re.fullmatch(r"bytes=(\d+)-", header).group(1)) if header and srv.ranges else 0
        if start >= len(body) > 0 and header:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(body)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        payload = body[start:]
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if name in srv.truncate:
            srv.truncate.discard(name)
            payload = payload[:len(payload) // 2]
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.files, httpd.requests, httpd.truncate, httpd.ranges = dict(GZ), [], set(), True
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/data/"
    # shutdown() waits for the loop to look at its flag, every poll_interval (by default 0.5 s)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


@pytest.fixture
def closed_port_url():
    with socket.socket() as sock:  # bind an ephemeral port, then close it: connecting is refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/data/"


def _fetch(tmp_path, url, files=FILES, log=None):
    return prepare.fetch_files(files, tmp_path / "out", base_url=url, timeout=5.0,
                               log=(log.append if log is not None else lambda _: None))


def _assert_installed(folder: Path, names=tuple(PLAIN)):
    for name in names:
        assert (folder / name).read_bytes() == PLAIN[name], name
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)  # no .part, no temp files


def test_fetch_installs_every_file_and_a_rerun_touches_nothing(tmp_path, server):
    paths = _fetch(tmp_path, server.url)
    assert paths == [tmp_path / "out" / name for name in PLAIN]
    _assert_installed(tmp_path / "out")
    assert server.requests == [(name + ".gz", None) for name in PLAIN]
    log = []
    assert _fetch(tmp_path, server.url, log=log) == paths
    assert len(server.requests) == 3  # nothing downloaded again
    assert all("present, sha256 ok" in line for line in log)


def test_checksum_mismatch_names_the_file_and_installs_nothing(tmp_path, server):
    wrong = "0" * 64
    files = (prepare.RemoteFile("b.de.gz", "b.de", wrong),) + FILES[:1]
    found = hashlib.sha256(PLAIN["b.de"]).hexdigest()
    expected = rf"b\.de\.gz: sha256 of the decompressed b\.de is {found}, expected {wrong}; b\.de not install"
    with pytest.raises(prepare.ChecksumError, match=expected):
        _fetch(tmp_path, server.url, files=files)
    assert list((tmp_path / "out").iterdir()) == []  # neither b.de, nor its .part, nor a temp file


def test_truncated_transfer_fails_and_a_rerun_resumes_with_a_range_request(tmp_path, server):
    server.truncate = {"b.de.gz"}
    size = len(GZ["b.de.gz"])
    with pytest.raises(prepare.DownloadError, match=rf"broke off after {size // 2} of {size} bytes; rerun"):
        _fetch(tmp_path, server.url)
    out = tmp_path / "out"
    assert (out / "b.de.gz.part").stat().st_size == size // 2
    assert not (out / "b.de").exists()
    _fetch(tmp_path, server.url)
    _assert_installed(out)
    assert server.requests[-2:] == [("b.de.gz", None), ("b.de.gz", f"bytes={size // 2}-")]


def test_server_without_range_support_restarts_the_download(tmp_path, server):
    server.truncate, server.ranges = {"a.de.gz"}, False
    with pytest.raises(prepare.DownloadError, match="broke off"):
        _fetch(tmp_path, server.url)
    log = []
    _fetch(tmp_path, server.url, log=log)
    _assert_installed(tmp_path / "out")
    assert any("does not resume" in line for line in log)


@pytest.mark.parametrize("garbage_size", [11, len(GZ["a.de.gz"]), len(GZ["a.de.gz"]) + 7])
def test_corrupt_part_is_deleted_and_downloaded_again_once(tmp_path, server, garbage_size):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.de.gz.part").write_bytes(b"\x1f\x8b" + bytes(garbage_size - 2))
    log = []
    _fetch(tmp_path, server.url, log=log)
    _assert_installed(out)
    a_de = [r for r in server.requests if r[0] == "a.de.gz"]
    assert a_de == [("a.de.gz", f"bytes={garbage_size}-"), ("a.de.gz", None)]  # resumed (or 416), then fresh
    assert any("failed its check" in line for line in log)


def test_connection_refused_fails_fast_saying_what_to_put_where(tmp_path, closed_port_url):
    start = time.monotonic()
    with pytest.raises(prepare.DownloadError) as info:
        _fetch(tmp_path, closed_port_url)
    assert time.monotonic() - start < 5.0  # no retries, no long timeouts
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"cannot reach {closed_port_url}a.en.gz (")
    assert f"download a.en.gz, a.de.gz, b.de.gz from {closed_port_url} into {tmp_path / 'out'}/" in message
    assert list((tmp_path / "out").iterdir()) == []


def test_gzips_put_in_the_folder_by_hand_are_used_offline(tmp_path, closed_port_url):
    out = tmp_path / "out"
    out.mkdir()
    for name, data in GZ.items():
        (out / name).write_bytes(data)
    _fetch(tmp_path, closed_port_url)
    for name in PLAIN:
        assert (out / name).read_bytes() == PLAIN[name]
    assert all((out / name).is_file() for name in GZ)  # the user's files are left alone


def test_a_present_file_with_the_wrong_hash_is_replaced(tmp_path, server):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.en").write_bytes(PLAIN["a.en"][:-1])
    log = []
    _fetch(tmp_path, server.url, log=log)
    _assert_installed(out)
    assert "present but sha256" in log[0]


def test_unknown_data_set(tmp_path):
    with pytest.raises(ValueError, match=r"unknown data set 'wmt99'; choose from "
                                         r"\['multi30k', 'ptb_sample'\]"):
        prepare.prepare("wmt99", tmp_path)


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "transformer_jax.data.prepare", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_help_and_user_errors(tmp_path, closed_port_url):
    helped = _run_cli("--help")  # absl exits 1 after printing the help
    for flag in ("--dir", "--base_url", "--timeout"):
        assert flag in helped.stdout
    assert "python -m transformer_jax.data.prepare multi30k" in helped.stdout
    assert "python -m transformer_jax.data.prepare ptb_sample" in helped.stdout
    for args, expected in [
        (("multi30k", f"--dir={tmp_path / 'm'}", f"--base_url={closed_port_url}"), "cannot reach"),
        (("multi30k",), "--dir is required"),
        (("wmt99", f"--dir={tmp_path}"), "unknown data set"),
    ]:
        failed = _run_cli(*args)
        assert failed.returncode != 0, args
        assert expected in failed.stderr
        assert "Traceback" not in failed.stderr
        assert len(failed.stderr.strip().splitlines()) <= 2, failed.stderr


def _run_cache(*args):
    return subprocess.run([sys.executable, "-m", "transformer_jax.prepare_cache", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cache_builds_a_configs_data_cache_once_and_refuses_what_has_none(tmp_path):
    for split, count in (("train", 60), ("val", 3), ("test", 3)):
        for lang, word in (("en", "house"), ("de", "haus")):
            (tmp_path / f"{split}.{lang}").write_text("".join(f"the {word} {i}\n" for i in range(count)))
    config = ["--config=configs/multi30k.py", f"--config.data.dir={tmp_path}", "--config.data.vocab_size=30",
              f"--config.data.cache_dir={tmp_path / 'cache'}"]
    built = _run_cache(*config)
    assert built.returncode == 0, built.stderr
    ready = f"Data cache ready in {tmp_path / 'cache'}: the tokenizer and 60 encoded train pairs"
    assert ready in built.stdout
    assert "60 train pairs encoded into" in built.stdout
    again = _run_cache(*config)
    assert again.returncode == 0 and "60 train pairs mapped from" in again.stdout  # found, not built again
    for args, expected in [
        ((), "--config=CONFIG is required"),
        (("--config=configs/default.py",), "source='synthetic' is built in memory"),
    ]:
        failed = _run_cache(*args)
        assert failed.returncode == 1 and expected in failed.stderr and "Traceback" not in failed.stderr
    # The command it was before: one line naming the new one.
    moved = _run_cli("cache", *config)
    assert moved.returncode == 1 and "Traceback" not in moved.stderr
    assert moved.stderr.splitlines()[0] == (
        "error: the data cache is built by its own command now: python -m transformer_jax.prepare_cache "
        "--config=CONFIG (the same flags as before)")


def test_the_data_package_does_not_import_the_run_config():
    """data/ sits below the run config: no module of it imports ``transformer_jax.run_config`` (nor the entry
    points), at the top or inside a function."""
    import ast

    upward = ("transformer_jax.run_config", "transformer_jax.prepare_cache")
    for path in sorted((REPO / "transformer_jax" / "data").glob("*.py")):
        name = path.name
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module or ""]
            else:
                continue
            assert not [n for n in names if n.startswith(upward)], (name, names)


def test_multi30k_table_matches_the_shared_files():
    if not SHARED_MULTI30K.is_dir():
        pytest.skip(f"shared Multi30k data not found at {SHARED_MULTI30K}")
    assert [f.local for f in prepare.MULTI30K_FILES] == [
        "train.en", "train.de", "val.en", "val.de", "test.en", "test.de"]
    for file in prepare.MULTI30K_FILES:
        assert hashlib.sha256((SHARED_MULTI30K / file.local).read_bytes()).hexdigest() == file.sha256, file


def test_cli_installs_real_multi30k_from_a_local_mirror(tmp_path, server):
    if not SHARED_MULTI30K.is_dir():
        pytest.skip(f"shared Multi30k data not found at {SHARED_MULTI30K}")
    server.files = {
        f.remote: gzip.compress((SHARED_MULTI30K / f.local).read_bytes(), compresslevel=1, mtime=0)
        for f in prepare.MULTI30K_FILES}
    out = tmp_path / "multi30k"
    done = _run_cli("multi30k", f"--dir={out}", f"--base_url={server.url}")
    assert done.returncode == 0, done.stderr
    assert "6 files ready" in done.stdout
    for file in prepare.MULTI30K_FILES:
        assert (out / file.local).read_bytes() == (SHARED_MULTI30K / file.local).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(f.local for f in prepare.MULTI30K_FILES)


# ------------------------------------------------------------------------ ptb_sample: a zip of .mrg files

MRG = {f"wsj_{i:04d}.mrg": f"( (S (NP-SBJ (NNP Name{i}) ) (VP (VBZ runs) ) (. .) ))\n".encode() * (40 + i)
       for i in (1, 2, 3, 4, 5)}
MRG_SHA256 = hashlib.sha256(b"".join(MRG[name] for name in sorted(MRG))).hexdigest()
ZIP_FOLDER = "treebank/combined/"


def _zip(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


# The layout of nltk_data's treebank.zip: the same names under other folders are not installed.
TREEBANK_ZIP = _zip({"treebank/README": b"readme\n",
                     **{f"treebank/parsed/{n[:-4]}.prd": b"(S x)\n" for n in MRG},
                     **{ZIP_FOLDER + name: data for name, data in MRG.items()},
                     ZIP_FOLDER + "wsj_0006.mrg": b"(not installed)\n"})
SMALL_ZIP = prepare.RemoteZip("treebank.zip", ZIP_FOLDER, tuple(sorted(MRG)), MRG_SHA256)


@pytest.fixture
def small_ptb_sample(monkeypatch, server):
    """``prepare("ptb_sample")`` on the synthetic zip: its five files and their hash, served locally."""
    monkeypatch.setitem(prepare.DATASETS, "ptb_sample",
                        (server.url, (dataclasses.replace(prepare.PTB_SAMPLE_ZIP, locals=SMALL_ZIP.locals,
                                                          sha256=MRG_SHA256),)))
    server.files = {"treebank.zip": TREEBANK_ZIP}
    return server


def _assert_mrg_installed(folder: Path, extra=()):
    for name, data in MRG.items():
        assert (folder / name).read_bytes() == data, name
    assert sorted(p.name for p in folder.iterdir()) == sorted([*MRG, *extra])  # no .part, no temp files


def test_ptb_sample_installs_the_combined_files_prints_the_terms_and_a_rerun_touches_nothing(
        tmp_path, small_ptb_sample):
    log = []
    paths = prepare.prepare("ptb_sample", tmp_path / "ptb", timeout=5.0, log=log.append)
    assert paths == [tmp_path / "ptb" / name for name in sorted(MRG)]
    _assert_mrg_installed(tmp_path / "ptb")
    assert "This data is for non-commercial use only." in log[0] and "(C) LDC 1995" in log[0]
    assert log[-1] == f"{tmp_path / 'ptb' / 'wsj_0001.mrg'} .. wsj_0005.mrg: downloaded from " \
                      f"{small_ptb_sample.url}treebank.zip, sha256 ok"
    log = []
    assert prepare.prepare("ptb_sample", tmp_path / "ptb", timeout=5.0, log=log.append) == paths
    assert small_ptb_sample.requests == [("treebank.zip", None)]  # nothing downloaded again
    assert "present, sha256 ok" in log[-1] and "terms of use" in log[0]


def test_ptb_sample_hash_mismatch_names_both_hashes_and_installs_nothing(tmp_path, small_ptb_sample):
    altered = dict(MRG, **{"wsj_0003.mrg": MRG["wsj_0003.mrg"].replace(b"runs", b"walks")})
    small_ptb_sample.files = {"treebank.zip": _zip({ZIP_FOLDER + n: d for n, d in altered.items()})}
    found = hashlib.sha256(b"".join(altered[n] for n in sorted(altered))).hexdigest()
    with pytest.raises(prepare.ChecksumError, match=(
            rf"treebank\.zip: sha256 of the extracted wsj_0001\.mrg \.\. wsj_0005\.mrg concatenated in name "
            rf"order is {found}, expected {MRG_SHA256}; wsj_0001\.mrg \.\. wsj_0005\.mrg not installed")):
        prepare.prepare("ptb_sample", tmp_path / "ptb", timeout=5.0, log=lambda _: None)
    assert list((tmp_path / "ptb").iterdir()) == []  # no .mrg, no .part, no temp file


def test_ptb_sample_zip_without_a_file_says_which(tmp_path, server):
    server.files = {"treebank.zip": _zip({ZIP_FOLDER + n: d for n, d in MRG.items() if n != "wsj_0004.mrg"})}
    with pytest.raises(prepare.ChecksumError, match=r"1 of the 5 files to install are not in its folder "
                                                    r"treebank/combined/, e\.g\. wsj_0004\.mrg"):
        _fetch(tmp_path, server.url, files=(SMALL_ZIP,))
    assert list((tmp_path / "out").iterdir()) == []


def test_ptb_sample_truncated_zip_resumes_and_a_corrupt_resume_downloads_again(tmp_path, server):
    server.files, server.truncate = {"treebank.zip": TREEBANK_ZIP}, {"treebank.zip"}
    size = len(TREEBANK_ZIP)
    with pytest.raises(prepare.DownloadError, match=rf"broke off after {size // 2} of {size} bytes; rerun"):
        _fetch(tmp_path, server.url, files=(SMALL_ZIP,))
    out = tmp_path / "out"
    assert (out / "treebank.zip.part").stat().st_size == size // 2 and not (out / "wsj_0001.mrg").exists()
    _fetch(tmp_path, server.url, files=(SMALL_ZIP,))
    _assert_mrg_installed(out)
    assert server.requests[-1] == ("treebank.zip", f"bytes={size // 2}-")

    # A .part that is a full-length zip of the wrong bytes: resumed (416), fails, fetched afresh once.
    for name in MRG:
        (out / name).unlink()
    (out / "treebank.zip.part").write_bytes(bytes(size))
    log = []
    _fetch(tmp_path, server.url, files=(SMALL_ZIP,), log=log)
    _assert_mrg_installed(out)
    assert server.requests[-2:] == [("treebank.zip", f"bytes={size}-"), ("treebank.zip", None)]
    assert any("failed its check (not a complete zip file" in line for line in log)


def test_ptb_sample_offline_fails_fast_and_a_zip_put_there_by_hand_is_used(tmp_path, closed_port_url):
    start = time.monotonic()
    with pytest.raises(prepare.DownloadError) as info:
        _fetch(tmp_path, closed_port_url, files=(SMALL_ZIP,))
    assert time.monotonic() - start < 5.0
    assert str(info.value).startswith(f"cannot reach {closed_port_url}treebank.zip (")
    assert f"download treebank.zip from {closed_port_url} into {tmp_path / 'out'}/" in str(info.value)
    (tmp_path / "out" / "treebank.zip").write_bytes(TREEBANK_ZIP)
    _fetch(tmp_path, closed_port_url, files=(SMALL_ZIP,))
    _assert_mrg_installed(tmp_path / "out", extra=("treebank.zip",))  # the user's zip is left alone


def _shared_ptb_sample_files() -> list[Path]:
    if not SHARED_PTB_SAMPLE.is_dir():
        pytest.skip(f"shared Penn Treebank sample not found at {SHARED_PTB_SAMPLE}")
    return sorted(SHARED_PTB_SAMPLE.glob("wsj_*.mrg"))


def test_ptb_sample_hash_matches_the_shared_files():
    files = _shared_ptb_sample_files()
    assert [p.name for p in files] == list(prepare.PTB_SAMPLE_ZIP.locals)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
    assert digest == prepare.PTB_SAMPLE_ZIP.sha256


def test_cli_installs_the_real_ptb_sample_from_a_local_mirror(tmp_path, server):
    files = _shared_ptb_sample_files()
    server.files = {"treebank.zip": _zip({ZIP_FOLDER + p.name: p.read_bytes() for p in files})}
    out = tmp_path / "ptb_sample"
    done = _run_cli("ptb_sample", f"--dir={out}", f"--base_url={server.url}")
    assert done.returncode == 0, done.stderr
    assert "199 files ready" in done.stdout and "non-commercial use only" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == [p.name for p in files]
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in files)
