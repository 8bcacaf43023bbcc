"""The data pipeline at a corpus's size: the first start, a warm start and the iterator's batches/s.

    python -m transformer_jax.benchmarks.data --data_dir=data/multi30k --pairs=4500000 --workdir=/tmp/bench
        [--paths=cache,in_memory] [--vocab_size=37000] [--tokens_per_batch=25000] [--batches=300]

``--pairs`` > 0 first writes a corpus of that many pairs into ``--workdir``/corpus (once; reused after)
from ``--data_dir``'s train files: pair k joins two of their lines, so sentences are about WMT's length
(~25 words a side for Multi30k's ~12). Each path is then timed in fresh processes, as a run would meet it:

- ``cache``: the data cache (``data/corpus_cache.py``). 'first start': an empty cache, so the tokenizer is
  trained and the train split encoded into it; 'warm start': a new workdir on the same data (a new run, a
  resume, another process or sweep row), which maps the entries.
- ``in_memory``: what every start did before the cache, and what synthetic and treebank sources still
  do: the train split read into memory and encoded again ('warm start': only the tokenizer is kept).

Each start records its seconds until the first batch, the start process's peak resident memory (VmHWM,
with glibc set as train.py sets it, ``runtime/host_memory.py``), the largest of its child processes'
(a build's) and how much the data added to the resident memory after ``--batches`` batches. Then the
iterator's batches/s at ``--tokens_per_batch`` is set beside what the paper's base model would consume on
one H100 (bf16 dense peak 989 TFLOP/s at ``--mfu``, the step's FLOPs from ``model/flops.py``). One JSON
line per record.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from absl import flags

from transformer_jax.runtime import errors

H100_BF16_DENSE_FLOPS = 989e12  # NVIDIA's H100 SXM datasheet, dense (no sparsity)
_DEFAULT_DIR = "data/multi30k"  # where `python -m transformer_jax.data.prepare multi30k` puts it
PATHS = ("cache", "in_memory")


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """The flags of ``python -m transformer_jax.benchmarks.data``."""
    flags.DEFINE_string(
        "data_dir",
        _DEFAULT_DIR,
        "Folder of the text corpus (train.en, train.de, val.*, test.*).",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "pairs",
        0,
        "Pairs of the corpus to build from --data_dir's train files (0: use them as they are).",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "workdir",
        None,
        "Folder for the corpus, the caches and the runs' workdirs (required).",
        flag_values=flag_values,
    )
    flags.DEFINE_list("paths", list(PATHS), f"Data paths to time, of {list(PATHS)}.", flag_values=flag_values)
    flags.DEFINE_integer(
        "vocab_size",
        37000,
        "Shared SentencePiece vocabulary (the paper's EN-DE: 37000).",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "tokenizer_train_examples",
        2_000_000,
        "Pairs the tokenizer trains on (the WMT configs').",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "tokens_per_batch",
        25_000,
        "Token budget of a batch (the paper: ~25k a side).",
        flag_values=flag_values,
    )
    flags.DEFINE_integer(
        "batches",
        300,
        "Batches drawn after the first, for the iterator's rate and the memory it touches.",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "mfu", 0.4, "Model FLOPs utilization assumed for the H100 comparison.", flag_values=flag_values
    )


# ----------------------------------------------------------------------------- the corpus


def scaled_corpus(source_dir: Path, folder: Path, pairs: int) -> Path:
    """A corpus of ``pairs`` pairs in ``folder``: pair k is line k and line (7k + 3) of the source's train
    files, joined (mod their line count); val and test are copied. Written once, then reused."""
    done = folder / f"corpus-{pairs}.done"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    lines = {
        lang: (source_dir / f"train.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("en", "de")
    }
    n = len(lines["en"])
    first, second = np.arange(pairs) % n, (7 * np.arange(pairs) + 3) % n
    for lang, text in lines.items():
        with open(folder / f"train.{lang}", "w", encoding="utf-8") as f:
            for start in range(0, pairs, 100_000):
                f.write(
                    "".join(
                        f"{text[a]} {text[b]}\n"
                        for a, b in zip(
                            first[start : start + 100_000], second[start : start + 100_000], strict=True
                        )
                    )
                )
        for split in ("val", "test"):
            shutil.copy(source_dir / f"{split}.{lang}", folder / f"{split}.{lang}")
    done.touch()
    return folder


# ----------------------------------------------------------------------------- one start, in a fresh process


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def start(spec: dict) -> dict:
    """One start (in its own process): the tokenizer, the iterator, its first batch, then ``batches`` more."""
    from transformer_jax.runtime import host_memory

    host_memory.keep_freed_memory()  # as train.py: a start-up's peak stays for the whole run
    from transformer_jax.data import batching, config, pipeline, sources, tokenizer

    rss_before = _status_kib("VmRSS")
    began = time.perf_counter()
    cfg = config.default_data_config(**spec["data"])
    if spec["path"] == "cache":
        tok = pipeline.load_or_train_tokenizer(cfg, spec["workdir"])
        iterator = pipeline.make_train_iterator(cfg, tok, seed=0)
    else:  # the code every start ran before the data cache: read the split whole, encode it
        model = tokenizer.tokenizer_file(spec["workdir"])
        if not model.exists():
            sentences = list(tokenizer.training_sentences(cfg))
            proto = tokenizer.train_tokenizer(sentences, vocab_size=cfg.vocab_size, vocab_type=cfg.vocab_type)
            del sentences
            model.parent.mkdir(parents=True)
            model.write_bytes(proto)
        tok = tokenizer.Tokenizer.from_file(model)
        data = batching.tokenize_pairs(sources.get_source(cfg).pairs("train"), tok)
        fits = np.maximum(data.src_lengths, data.tgt_lengths) <= cfg.max_len
        iterator = batching.TrainIterator(
            data.select(fits),
            length_buckets=cfg.length_buckets,
            tokens_per_batch=cfg.tokens_per_batch,
            seed=0,
        )
    next(iterator)
    first_batch = time.perf_counter() - began
    rss_first = _status_kib("VmRSS")
    began = time.perf_counter()
    tokens = 0
    for _ in range(spec["batches"]):
        batch = next(iterator)
        tokens += int(np.count_nonzero(batch["targets"]))
    rate = spec["batches"] / (time.perf_counter() - began)
    return {
        "seconds_to_first_batch": round(first_batch, 2),
        "peak_rss_gb": round(_status_kib("VmHWM") / 2**20, 2),
        "children_peak_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2),
        "data_rss_gb_at_first_batch": round((rss_first - rss_before) / 2**20, 2),
        "data_rss_gb_after_batches": round((_status_kib("VmRSS") - rss_before) / 2**20, 2),
        "pairs": iterator.num_examples,
        "batches_per_s": round(rate, 1),
        "target_tokens_per_batch": round(tokens / spec["batches"]),
    }


def _in_fresh_process(spec: dict) -> dict:
    """``start(spec)`` in a new Python process; its JSON result."""
    code = (
        "import json, sys; from transformer_jax.benchmarks import data; "
        "print('RESULT ' + json.dumps(data.start(json.loads(sys.argv[1]))))"
    )
    done = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"a benchmark start failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.split("RESULT ", 1)[1])


# ----------------------------------------------------------------------------- the H100 comparison


def h100_batches_per_s(tokens_per_batch: int, mfu: float) -> dict:
    """Batches/s the paper's base model would consume on one H100: its train step's FLOPs at a batch of
    ``tokens_per_batch`` padded tokens a side (as 25k-token batches of 25-token sentences would be, the
    length of a typical WMT bucket), at ``mfu`` of the bf16 dense peak."""
    from transformer_jax.model import flops
    from transformer_jax.model.config import ModelConfig

    length = 32  # a typical bucket of WMT14's ~25-token sentences (length_buckets of the WMT configs)
    rows = tokens_per_batch // length
    step_flops = flops.train_step_flops(ModelConfig(vocab_size=37000), rows, length, length)
    rate = mfu * H100_BF16_DENSE_FLOPS / step_flops
    return {
        "record": "h100_base_model",
        "step_tflop": round(step_flops / 1e12, 2),
        "mfu": mfu,
        "batches_per_s": round(rate, 2),
        "arithmetic": f"{mfu} x {H100_BF16_DENSE_FLOPS / 1e12:.0f} TFLOP/s "
        f"/ {step_flops / 1e12:.2f} TFLOP a step ({rows} rows x {length} tokens a side, base model, "
        "37k vocabulary)",
    }


def main(argv: list[str]) -> None:
    args = flags.FLAGS
    if not args.workdir:
        raise errors.ConfigError("--workdir is required: the folder for the corpus, the caches and the runs")
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown:
        raise errors.ConfigError(f"--paths: unknown {unknown}; choose from {list(PATHS)}")
    source_dir = Path(args.data_dir)
    if not (source_dir / "train.en").is_file():
        raise errors.MissingFileError(
            f"--data_dir={source_dir} holds no train.en; pass a text corpus folder, as "
            "`python -m transformer_jax.data.prepare multi30k --dir=DIR` makes it"
        )
    workdir = Path(args.workdir)
    corpus = scaled_corpus(source_dir, workdir / "corpus", args.pairs) if args.pairs else source_dir
    data = dict(
        source="text",
        dir=str(corpus),
        src_lang="en",
        tgt_lang="de",
        vocab_size=args.vocab_size,
        tokenizer_train_examples=args.tokenizer_train_examples,
        max_len=256,
        tokens_per_batch=args.tokens_per_batch,
        length_buckets=(16, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256),
    )
    for path in args.paths:
        cache = workdir / f"cache-{path}"
        shutil.rmtree(cache, ignore_errors=True)
        for attempt, run in (("first start", "run1"), ("warm start", "run2")):
            run_dir = workdir / f"{path}-{run}"
            shutil.rmtree(run_dir, ignore_errors=True)
            if path == "in_memory" and run == "run2":
                shutil.copytree(workdir / f"{path}-run1", run_dir)  # its tokenizer, as a resume keeps it
            spec = {
                "path": path,
                "workdir": str(run_dir),
                "batches": args.batches,
                "data": {**data, "cache_dir": str(cache)},
            }
            record = {"record": "start", "path": path, "start": attempt, **_in_fresh_process(spec)}
            print(json.dumps(record), flush=True)
    print(json.dumps(h100_batches_per_s(args.tokens_per_batch, args.mfu)), flush=True)


if __name__ == "__main__":
    define_flags()
    errors.run_main(main)
