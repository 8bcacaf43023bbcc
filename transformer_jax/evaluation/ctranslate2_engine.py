"""CTranslate2 as a second decoding engine: export a trained model to it, and decode through it.

CTranslate2 (https://github.com/OpenNMT/CTranslate2) is a C++ inference engine for encoder-decoder
Transformers. How our parameters map to its ``TransformerSpec``, and which models can be exported, is
``ctranslate2_spec``'s; this module writes an export folder (:func:`write_model`, :func:`export_workdir`),
checks one before it is read (its record, tokenizer and run), and decodes with it. The export's config has
CTranslate2 append EOS to each source (``add_source_eos``), as our model was trained, so that its own API
decodes the export right; PAD is banned and the minimum output length is 0.

Decoding (:class:`Engine`) keeps the contract of ``translation.decode_ids``: ids in, outputs in ``decode``'s
convention out. Greedy search gives the same tokens as ours. Beam search differs in three documented ways:
CTranslate2's length penalty is the plain power |Y|^p, so the GNMT penalty ((5 + |Y|) / 6)^alpha is matched at
each source's length (:func:`matched_length_penalty`); its beam stops after ``beam_size`` finished hypotheses;
and it keeps a hypothesis that ends (EOS) only when it is among the best ``beam_size`` of the step's
``2 * beam_size`` candidates, ours wherever it ends among them (the same alive ones otherwise, so without a
length penalty ours is never less probable). Sources are decoded in one call per length, so that each has its
own length limit and penalty and no output depends on the other sources.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from transformer_jax.evaluation.ctranslate2_spec import (
    check_exportable,
    exported_positions,
    import_ctranslate2,
    model_spec,
    to_bfloat16,
)
from transformer_jax.model.special_ids import EOS_ID, PAD_ID
from transformer_jax.runtime import disk, errors, output_file
from transformer_jax.runtime.errors import ConfigError, DataError, DiskFullError, MissingFileError, UserError

# What ``--quantization`` takes: CTranslate2's weight types. bfloat16 runs on GPUs and on CPUs with
# AVX512-BF16 builds; elsewhere CTranslate2 computes in the closest type it supports.
QUANTIZATIONS = ("float32", "int8", "int8_float32", "bfloat16")
RECORD_FILE = "export.json"  # what was exported, beside CTranslate2's own files
# Inside every folder the export makes (the export, its staging and moved-aside folders): the maker's pid and
# host, and the folder's name. Leftover cleanup and the rename back into place take only folders whose marker
# names the pid in their name, on this host, and that very name; anything else beside an export (a user's
# backup, even a copy of an export renamed like a leftover) is never touched.
MARKER_FILE = ".made_by_transformer_jax_export"
TOKENIZER_FILE = "spm.model"
VOCABULARY_FILE = "shared_vocabulary.json"  # CTranslate2's, written when source and target share one
# --threads above this many per CPU is refused: CTranslate2 starts every thread asked for (100000 crashed
# it), and more threads than cores only wait for each other.
MAX_THREADS_PER_CPU = 4


class DamagedExportError(UserError, RuntimeError):
    """An export's files do not read (deleted, cut short, changed); the message says how to remake it."""


def check_threads(threads: int | None) -> None:
    """ConfigError for ``--threads`` above ``MAX_THREADS_PER_CPU`` times this machine's CPUs."""
    cpus = os.cpu_count() or 1
    if threads is not None and threads > MAX_THREADS_PER_CPU * cpus:
        raise ConfigError(f"--threads={threads}: expected at most {MAX_THREADS_PER_CPU * cpus} "
                          f"({MAX_THREADS_PER_CPU} per CPU; this machine has {cpus}); 0 takes CTranslate2's "
                          "default, one per core")


def default_quantization(d_model: int) -> str:
    """The weight type that decoded fastest on a CPU at this width (docs/translation.md)."""
    return "float32" if d_model < 256 else "int8"


def config_sha256(saved_config: Mapping[str, Any]) -> str:
    """The hex SHA-256 of a run's saved JSON config (keys sorted): which run an export came from."""
    return hashlib.sha256(json.dumps(saved_config, sort_keys=True).encode()).hexdigest()


def write_model(params: Mapping[str, Any], model_config, out_dir: str, *, pieces: Sequence[str],
                quantization: str, record: Mapping[str, Any], tokenizer_path: str | None = None,
                out_flag: str = "--out") -> None:
    """Exports ``params`` into ``out_dir``: CTranslate2's model files, ``RECORD_FILE`` and the tokenizer.

    The folder is written beside ``out_dir`` (``<out_dir>.<pid>.tmp``) and renamed into place (the
    previous one moved to ``<out_dir>.<pid>.old`` and removed), so ``out_dir`` holds a complete export or
    its previous content; each of these folders holds ``MARKER_FILE`` naming this process, and what a
    killed exporter left is cleaned up first (:func:`recover_leftovers`). A full disk raises DiskFullError
    naming ``out_dir``'s filesystem (and ``out_flag``, the option that chose it). ``pieces`` is the
    vocabulary (one string a token id); ``tokenizer_path``, when given, is copied in as ``TOKENIZER_FILE``.
    ``record`` is what was exported (step, averaging, config hash, decoding defaults); the model's fields,
    the weight type, the SHA-256
    of each of CTranslate2's files (``files_sha256``: model.bin, its config and vocabulary) and the
    positions the export decodes (``positions``: ``exported_positions``, None for any length) are added.
    """
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization={quantization}: expected one of {', '.join(QUANTIZATIONS)}")
    if len(pieces) != model_config.vocab_size:
        raise ConfigError(f"the vocabulary has {len(pieces)} pieces but the model's has "
                          f"{model_config.vocab_size}; export with the run's own tokenizer")
    spec = model_spec(params, model_config, pieces)
    if quantization == "bfloat16":
        to_bfloat16(spec)
    spec.validate()
    spec.optimize(quantization=quantization)
    out_dir = os.path.abspath(out_dir)
    recover_leftovers(out_dir)
    staging, previous = f"{out_dir}.{os.getpid()}.tmp", f"{out_dir}.{os.getpid()}.old"
    for path in (staging, previous):
        if os.path.lexists(path) and not _made_by(path, os.getpid()):
            raise ConfigError(f"{path} exists and was not made by this export; move it away (the export "
                              "writes and removes a folder of that name)")
        shutil.rmtree(path, ignore_errors=True)  # this pid's, from an earlier process of the same pid
    try:
        os.makedirs(staging)
        _mark(staging)
        spec.save(staging)
        files = {name: _sha256(os.path.join(staging, name)) for name in sorted(os.listdir(staging))
                 if name != MARKER_FILE}
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, os.path.join(staging, TOKENIZER_FILE))
        model = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config)}
        with open(os.path.join(staging, RECORD_FILE), "w") as f:
            json.dump({"format": "ctranslate2", "quantization": quantization, **record,
                       "files_sha256": files, "positions": exported_positions(model_config), "model": model},
                      f, indent=1)
        if os.path.exists(out_dir):
            _mark(out_dir, as_name=os.path.basename(previous))  # about to be moved aside as that
            os.rename(out_dir, previous)
        os.rename(staging, out_dir)
        shutil.rmtree(previous, ignore_errors=True)
    except Exception as e:
        if not disk.is_disk_full(e):
            raise
        kept = "the previous export there is kept" if os.path.exists(out_dir) else "nothing was written"
        raise DiskFullError(f"no space left writing the export to {out_dir}: "
                            f"{disk.describe_filesystem(out_dir)} ran out of space; {kept}. Free some space "
                            f"or choose another {out_flag}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _mark(folder: str, as_name: str | None = None) -> None:
    """Writes ``MARKER_FILE`` into ``folder``: made (or moved aside) by this process on this host, as the
    folder named ``as_name`` (default: its own name)."""
    with open(os.path.join(folder, MARKER_FILE), "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                   "folder": as_name or os.path.basename(folder)}, f)


def _made_by(folder: str, pid: int) -> bool:
    """Whether ``folder`` holds a ``MARKER_FILE`` naming process ``pid`` on this host and ``folder``'s own
    name (a copy of a marked folder under another name is not that folder)."""
    try:
        with open(os.path.join(folder, MARKER_FILE)) as f:
            maker = json.load(f)
    except (OSError, ValueError):
        return False
    return (isinstance(maker, dict) and maker.get("pid") == pid and maker.get("host") == socket.gethostname()
            and maker.get("folder") == os.path.basename(folder))


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def recover_leftovers(out_dir: str) -> None:
    """Cleans up what an exporter killed mid-way (kill -9, a crash) left beside ``out_dir``.

    Its staging folder ``<out_dir>.<pid>.tmp`` is removed. Its ``<out_dir>.<pid>.old`` is the previous
    export: moved back to ``out_dir`` when the exporter died between its two renames (``out_dir`` missing),
    removed otherwise. Only folders whose ``MARKER_FILE`` names that pid on this host and their own name
    are taken, and only once that process is gone: a user's ``<out_dir>.20261206.old`` backup, or a copy of
    an export renamed ``<out_dir>.<pid in its marker>.old``, is never removed or renamed.
    """
    out_dir = os.path.abspath(out_dir)
    folder, name = os.path.split(out_dir)
    try:
        entries = sorted(os.listdir(folder), reverse=True)  # a newer pid's .old first (most likely)
    except OSError:
        return
    for entry in entries:
        pid, _, kind = entry.removeprefix(f"{name}.").partition(".")
        path = os.path.join(folder, entry)
        if not (entry.startswith(f"{name}.") and pid.isdigit() and kind in ("tmp", "old")
                and int(pid) != os.getpid() and output_file.process_is_gone(int(pid))
                and _made_by(path, int(pid))):
            continue
        if kind == "old" and not os.path.exists(out_dir):
            try:
                os.rename(path, out_dir)
            except OSError:
                pass  # left for a later try: it is the only copy of the previous export
            continue
        shutil.rmtree(path, ignore_errors=True)


def workdir_pieces(tokenizer) -> list[str]:
    """A tokenizer's vocabulary, one piece a token id: the strings CTranslate2 reads and writes."""
    return [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]


def export_command(model_dir: str, workdir: str | None) -> str:
    """The command that (re)makes the export in ``model_dir`` from ``workdir``."""
    command = f"python -m transformer_jax.export --workdir={workdir or '<train.py workdir>'}"
    if workdir is None or os.path.abspath(model_dir) != os.path.abspath(default_export_dir(workdir)):
        command += f" --out={model_dir}"
    return command


def _damaged(model_dir: str, what: str, workdir: str | None) -> DamagedExportError:
    return DamagedExportError(f"the CTranslate2 export in {model_dir} is damaged: {what}. Make it again "
                              f"with: {export_command(model_dir, workdir)}")


def read_record(model_dir: str, workdir: str | None = None) -> dict[str, Any]:
    """The ``RECORD_FILE`` of an export; MissingFileError (no export) or DamagedExportError (it does not
    read), each with the command that makes it (from ``workdir`` when given)."""
    path = os.path.join(model_dir, RECORD_FILE)
    if not os.path.isfile(path):
        raise MissingFileError(f"{model_dir} holds no CTranslate2 export ({RECORD_FILE} is missing); make "
                               f"one with: {export_command(model_dir, workdir)}")
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, found {type(record).__name__}")
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _damaged(model_dir, f"{RECORD_FILE} does not read ({errors.short_error(e)})", workdir) from None
    return record


def check_tokenizer_file(model_dir: str, record: Mapping[str, Any], workdir: str | None = None) -> None:
    """DamagedExportError when the export's ``TOKENIZER_FILE`` is missing or is not the one it recorded."""
    expected = record.get("tokenizer_sha256")
    if not expected:  # an export without a tokenizer (evaluate.py's temporary one)
        return
    try:
        with open(os.path.join(model_dir, TOKENIZER_FILE), "rb") as f:
            found = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        raise _damaged(model_dir, f"{TOKENIZER_FILE} does not read ({e.strerror or e})", workdir) from None
    if found != expected:
        raise _damaged(model_dir, f"{TOKENIZER_FILE} changed after the export (sha256 {found[:12]}..., "
                       f"{RECORD_FILE} records {expected[:12]}...)", workdir)


def check_model_files(model_dir: str, record: Mapping[str, Any], workdir: str | None = None) -> None:
    """DamagedExportError when a file CTranslate2 wrote (model.bin, its config, the vocabulary) is not the
    one the export recorded (``files_sha256``): one flipped bit keeps the size and decodes garbage. An
    export made before the hashes were recorded is not checked."""
    expected = record.get("files_sha256")
    if not isinstance(expected, dict):
        return
    for name, sha in expected.items():
        try:
            found = _sha256(os.path.join(model_dir, name))
        except OSError as e:
            raise _damaged(model_dir, f"{name} does not read ({e.strerror or e})", workdir) from None
        if found != sha:
            raise _damaged(model_dir, f"{name} changed after the export (sha256 {found[:12]}..., "
                           f"{RECORD_FILE} records {str(sha)[:12]}...)", workdir)


def check_export_of(workdir: str, model_dir: str, record: Mapping[str, Any]) -> None:
    """ConfigError when the export in ``model_dir`` was not made from ``workdir``'s run.

    Its recorded tokenizer must be the workdir's, and its recorded config hash the saved config of the
    exported step (or, when that checkpoint is gone, its model fields those of the newest step). A workdir
    without checkpoints or a tokenizer has nothing to compare with and passes.
    """
    from transformer_jax.checkpoints.reader import CheckpointReader
    from transformer_jax.checkpoints.restore import checkpoint_dir
    from transformer_jax.data.tokenizer import tokenizer_file
    from transformer_jax.run_config import run_config_from_saved

    def refuse(what: str) -> ConfigError:
        default = os.path.abspath(model_dir) == os.path.abspath(default_export_dir(workdir))
        return ConfigError(f"{model_dir} was exported from another run than --workdir={workdir} ({what}); "
                           "export this run's model with: python -m transformer_jax.export "
                           f"--workdir={workdir}" + ("" if default else " (then leave --export_dir out)"))

    tokenizer_path = tokenizer_file(workdir)
    if record.get("tokenizer_sha256") and tokenizer_path.is_file():
        found = hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()
        if found != record["tokenizer_sha256"]:
            raise refuse(f"its tokenizer has sha256 {record['tokenizer_sha256'][:12]}..., the workdir's "
                         f"{found[:12]}...")
    if not os.path.isdir(checkpoint_dir(workdir)) or "config_sha256" not in record:
        return
    reader = CheckpointReader(checkpoint_dir(workdir))
    steps = reader.all_steps()
    if not steps:
        return
    exported = record.get("step") in steps
    step, saved, _ = reader.saved_info(record["step"] if exported else None)
    run = run_config_from_saved(saved)
    if exported and config_sha256(run.saved) != record["config_sha256"]:
        raise refuse(f"step {step}'s saved config has sha256 {config_sha256(run.saved)[:12]}..., the export "
                     f"records {record['config_sha256'][:12]}...")
    model = {f.name: getattr(run.model, f.name) for f in dataclasses.fields(run.model)}
    differ = sorted(k for k in model.keys() & dict(record.get("model", {})).keys()
                    if model[k] != record["model"][k])
    if not exported and differ:
        raise refuse(f"its model differs from step {step}'s in {', '.join(differ)}")


def matched_length_penalty(alpha: float, lengths: Sequence[int]) -> float:
    """CTranslate2's length penalty p (scores log P / |Y|^p) closest to GNMT's ((5 + |Y|) / 6)^alpha.

    Beam search compares hypotheses of one sentence, so what matters is how the penalty changes with
    length: d log lp / d log |Y| is alpha |Y| / (5 + |Y|) for GNMT and p for the power. They are matched
    at |Y| = the median of ``lengths`` (source tokens, EOS included; outputs are about as long).
    """
    if alpha == 0 or not lengths:
        return 0.0
    typical = statistics.median(lengths)
    return alpha * typical / (5.0 + typical)


class Engine:
    """Decodes with an exported model: the contract of ``translation.decode_ids`` on CTranslate2.

    Args:
      model_dir: an export (:func:`write_model`).
      threads: CPU threads of one translation (CTranslate2's ``intra_threads``; 0: its default).
      compute_type: CTranslate2's compute type; "default" runs the exported weight type (or the closest
        one this CPU supports).
      max_batch_size: sentences per CTranslate2 batch (it sorts them by length first).
    """

    def __init__(self, model_dir: str, *, threads: int = 0, compute_type: str = "default",
                 max_batch_size: int = 64, workdir: str | None = None):
        ctranslate2 = import_ctranslate2()
        check_threads(threads)
        record = read_record(model_dir, workdir)  # an export of ours, or the error saying how to make one
        check_tokenizer_file(model_dir, record, workdir)
        check_model_files(model_dir, record, workdir)  # before CTranslate2 reads a file it may choke on
        try:
            self.translator = ctranslate2.Translator(model_dir, device="cpu", compute_type=compute_type,
                                                     inter_threads=1, intra_threads=threads)
            with open(os.path.join(model_dir, VOCABULARY_FILE), encoding="utf-8") as f:
                self.pieces = json.load(f)
            with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
                # An export made before add_source_eos is given the EOS of our sources itself.
                self.appends_eos = bool(json.load(f).get("add_source_eos"))
        except (OSError, RuntimeError, ValueError, IndexError) as e:  # a file missing, cut short or changed
            raise _damaged(model_dir, errors.short_error(e), workdir) from None
        vocab_size = record.get("model", {}).get("vocab_size", len(self.pieces))
        if not isinstance(self.pieces, list) or len(self.pieces) != vocab_size:
            raise _damaged(model_dir, f"{VOCABULARY_FILE} does not hold the model's {vocab_size} pieces",
                           workdir)
        self.ids = {piece: i for i, piece in enumerate(self.pieces)}
        self.max_batch_size = max_batch_size
        # The longest source + output the export decodes (None: any length, or an export that predates it).
        self.positions = record.get("positions")
        self.position_encoding = record.get("model", {}).get("position_encoding")

    @property
    def compute_type(self) -> str:
        return self.translator.compute_type

    def _source_pieces(self, ids: np.ndarray) -> list[str]:
        """CTranslate2's pieces of a source int32[len] (EOS included): without its EOS where the export's
        config has CTranslate2 append it."""
        ids = list(ids)
        if self.appends_eos and ids and ids[-1] == EOS_ID:
            ids = ids[:-1]
        return [self.pieces[t] for t in ids]

    def decode_ids(self, ids: Sequence[np.ndarray], settings, *,
                   progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
        """Each source int32[len_i] (EOS included) -> int32[len_i + max_extra_len] as ``decode`` gives it:
        the tokens, then EOS, then PAD; without EOS when the limit ``len_i + max_extra_len`` is reached.

        ``settings`` is a ``translation.Settings``: beam 1 is greedy search (the same tokens as ours);
        otherwise beam search with :func:`matched_length_penalty` of ``settings.alpha`` at the source's
        length.

        An output does not depend on the other sources: CTranslate2 takes one length limit and one length
        penalty a call, so the sources are decoded in one call per length, each under its own limit (a
        shared, longer limit let a beam outgrow a short sentence's limit, win, and be cut without EOS).
        A source whose limit passes the export's ``positions`` raises DataError before anything is decoded.
        """
        longest = max((len(s) for s in ids), default=0)
        if self.positions is not None and longest + settings.max_extra_len > self.positions:
            # Past a table CTranslate2 stops with a traceback; past ALiBi's exact buckets it decodes wrongly.
            raise DataError(f"a source of {longest} tokens (EOS included) and max_extra_len="
                            f"{settings.max_extra_len} need more than the {self.positions} positions this "
                            f"export of position_encoding={self.position_encoding!r} holds; decode it with "
                            "the JAX engine (--engine=jax), or pass a smaller --max_extra_len")
        outputs: list[np.ndarray | None] = [None] * len(ids)
        by_length: dict[int, list[int]] = {}
        for i, s in enumerate(ids):
            by_length.setdefault(len(s), []).append(i)
        for length, members in sorted(by_length.items()):
            limit = length + settings.max_extra_len
            results = self.translator.translate_batch(
                [self._source_pieces(ids[i]) for i in members], max_batch_size=self.max_batch_size,
                beam_size=settings.beam_size, length_penalty=matched_length_penalty(settings.alpha, [length]),
                max_input_length=0, max_decoding_length=limit, min_decoding_length=0,
                return_end_token=True, suppress_sequences=[[self.pieces[PAD_ID]]])
            for i, result in zip(members, results, strict=True):
                tokens = [self.ids[piece] for piece in result.hypotheses[0]][:limit]
                out = np.full(limit, PAD_ID, np.int32)
                out[:len(tokens)] = tokens
                outputs[i] = out
            if progress is not None:
                progress(len(members))
        return outputs

    def score(self, ids: Sequence[np.ndarray], outputs: Sequence[np.ndarray]) -> list[np.ndarray]:
        """float32[n_i + 1]: log P of each of the ``n_i`` output tokens before EOS (or PAD) and then of EOS,
        given the source and the tokens before it (teacher forcing)."""
        targets = []
        for out in outputs:
            out = list(np.asarray(out))
            end = min([out.index(t) for t in (EOS_ID, PAD_ID) if t in out], default=len(out))
            targets.append([self.pieces[i] for i in out[:end]])
        results = self.translator.score_batch([self._source_pieces(s) for s in ids], targets,
                                              max_batch_size=self.max_batch_size, max_input_length=0)
        return [np.asarray(r.log_probs, np.float32) for r in results]


def default_export_dir(workdir: str) -> str:
    """Where ``export`` writes and ``translate --engine=ctranslate2`` reads by default."""
    return os.path.join(workdir, "export", "ctranslate2")


def _check_out_folder(out_dir: str, out_flag: str) -> None:
    """ConfigError naming ``out_flag`` when the folder ``out_dir`` would be made in cannot be: its nearest
    existing parent is a file, or takes no new entry (read-only, no permission). Nothing is created."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{out_flag}={out_dir}: {parent} is a file, not a folder; choose another "
                          f"{out_flag}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{out_flag}={out_dir}: cannot write in {parent} (read-only or no permission); "
                          f"choose another {out_flag}")


def export_workdir(workdir: str, *, out_dir: str | None = None, quantization: str | None = None,
                   step: int | None = None, average_last: int | None = None,
                   out_flag: str = "--out") -> dict[str, Any]:
    """Exports a ``train.py`` workdir's model, averaged as ``translate`` averages it; returns the record.

    ``average_last`` None takes the run's ``final_average_last``; ``quantization`` None takes
    :func:`default_quantization` of its width. Everything is checked before anything is written; errors
    about ``out_dir`` name it as ``out_flag`` (translate's ``--export_dir``, export's ``--out``).
    """
    import_ctranslate2()
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"--quantization={quantization}: expected one of {', '.join(QUANTIZATIONS)}")
    for flag, value in (("step", step), ("average_last", average_last)):
        if value is not None and value < 0:
            raise ConfigError(f"--{flag}={value}: expected >= 0")
    out_dir = out_dir or default_export_dir(workdir)
    recover_leftovers(out_dir)
    if os.path.isfile(out_dir) or (os.path.isdir(out_dir) and os.listdir(out_dir)
                                   and not os.path.isfile(os.path.join(out_dir, RECORD_FILE))):
        raise ConfigError(f"{out_flag}={out_dir} exists and is not an export; choose a new or empty folder")
    _check_out_folder(out_dir, out_flag)
    from transformer_jax.checkpoints.restore import averaged_params, restore_workdir
    from transformer_jax.data.text_form import text_form_of
    from transformer_jax.data.tokenizer import tokenizer_file
    from transformer_jax.data.treebank import is_parsing

    restored = restore_workdir(workdir, step)
    run = restored.run
    if is_parsing(run.data):
        raise ConfigError(f"--workdir={workdir} is a parsing run; its decoding needs the tree constraint, "
                          "which CTranslate2 lacks. Parse with: python evaluate.py")
    check_exportable(restored.model_config)
    if average_last is None:
        average_last = run.eval.final_average_last
    params, steps = averaged_params(restored, average_last)
    quantization = quantization or default_quantization(restored.model_config.d_model)
    form = text_form_of(run.data)
    record = {
        "workdir": os.path.abspath(workdir), "config": run.name, "step": restored.step,
        "average_last": average_last, "averaged_steps": steps,
        "config_sha256": config_sha256(run.saved), "tokenizer_sha256": restored.tokenizer.sha256,
        "decoding": {"beam_size": run.eval.final_beam_size, "alpha": run.eval.final_alpha,
                     "max_extra_len": run.eval.final_max_extra_len},
        "text_form": {"name": form.name, "src_lang": form.src_lang, "tgt_lang": form.tgt_lang},
    }
    write_model(params, restored.model_config, out_dir, pieces=workdir_pieces(restored.tokenizer),
                quantization=quantization, record=record, tokenizer_path=str(tokenizer_file(workdir)),
                out_flag=out_flag)
    return read_record(out_dir)
