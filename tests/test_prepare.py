"""Tests for transformer_jax.data.prepare against a local HTTP server on 127.0.0.1 (no internet needed)."""

import gzip
import hashlib
import http.server
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from transformer_jax.data import prepare

REPO = Path(__file__).resolve().parents[1]
SHARED_MULTI30K = REPO.parent / "shared" / "data" / "multi30k"


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
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
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
    with pytest.raises(ValueError, match=r"unknown data set 'wmt99'; choose from \['multi30k'\]"):
        prepare.prepare("wmt99", tmp_path)


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "transformer_jax.data.prepare", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_help_and_user_errors(tmp_path, closed_port_url):
    helped = _run_cli("--help")  # absl exits 1 after printing the help
    for flag in ("--dir", "--base_url", "--timeout"):
        assert flag in helped.stdout
    assert "python -m transformer_jax.data.prepare multi30k" in helped.stdout
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
