"""transformer_jax.benchmarks: presets as ModelConfig overrides, the peak's best run, CLI flags, smoke runs.

Nothing here times anything for its own sake: speed lives in the benchmark, not in tests.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags

from transformer_jax.benchmarks import attention, data, decoding, presets, profile, train_step
from transformer_jax.model.config import ModelConfig
from transformer_jax.runtime import timing
from transformer_jax.runtime.errors import ConfigError, MissingFileError

REPO = Path(__file__).resolve().parents[1]
MICRO = dict(vocab_size=37, d_model=12, d_ff=20, num_heads=3, num_encoder_layers=1, num_decoder_layers=1)
# The decoding runs' preset: one greedy search shape, compiled once for the records and the profile.
MICRO_DECODE = presets.DecodePreset(MICRO, batch=3, src_len=5, new_tokens=4)


@pytest.mark.parametrize("name", list(presets.MODELS))
def test_presets_override_model_config_without_repeating_its_defaults(name):
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for key, value in presets.MODELS[name].items():
        assert key in fields, f"{name}: {key!r} is not a ModelConfig field"
        assert key not in ("deterministic", "decode", "dtype"), f"{name}: {key!r} is a mode, set by the run"
        default = fields[key].default
        assert value != default, f"{name}: {key}={value!r} repeats ModelConfig's default"
    presets.model_config(presets.MODELS[name])  # valid


def test_base_and_big_presets_are_the_papers_models():
    # Section 3 and Table 3 of the paper, typed here independently of ModelConfig's defaults.
    base = presets.model_config(presets.MODELS["base"])
    assert (base.d_model, base.d_ff, base.num_heads, base.d_k, base.d_v, base.num_encoder_layers,
            base.num_decoder_layers, base.dropout_rate) == (512, 2048, 8, 64, 64, 6, 6, 0.1)
    big = presets.model_config(presets.MODELS["big"])
    assert (big.d_model, big.d_ff, big.num_heads, big.d_k, big.num_encoder_layers,
            big.dropout_rate) == (1024, 4096, 16, 64, 6, 0.3)
    assert set(presets.DECODE_PRESETS) >= {"tiny", "base"}


def test_unknown_preset_names_fail_with_the_choices():
    with pytest.raises(ConfigError, match="tiny"):
        presets.check_names(["tiny", "huge"], presets.TRAIN_PRESETS, "--presets")


def test_throughput_mode_needs_a_file_and_a_workdir_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "transformer_jax.benchmarks.decoding",
                             f"--file={tmp_path / 'x.txt'}"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[0] == "error: --file and --workdir go together (a text file and the " \
        "model to translate it)"


@pytest.mark.parametrize("module, flag", [("decoding", "--presets=huge"), ("decoding", "--new_tokens=0"),
                                          ("attention", "--lengths=x"), ("profile", "--searches=wide")])
def test_a_bad_flag_value_is_one_line_not_a_traceback(module, flag):
    result = subprocess.run([sys.executable, "-m", f"transformer_jax.benchmarks.{module}", flag], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[0].startswith(f"error: {flag.split('=')[0]} takes")


def test_peak_is_the_best_run_and_reports_the_median_too():
    peak = timing.Peak.from_times(6e9, [3.0, 1.0, 2.0, 4.0, 5.0], dtype="float32", size=1)
    assert peak.best_flops == 6e9  # 6 GFLOP in the fastest run, 1 s
    assert peak.median_flops == 2e9  # the median run, 3 s
    fields = timing.mfu_fields(1.5e9, 1.0, peak)
    assert fields["mfu"] == 0.25 and fields["peak_best_gflops"] == 6.0 and fields["peak_median_gflops"] == 2.0


@pytest.mark.parametrize("module", [train_step, decoding, attention, data, profile])
def test_every_flag_has_a_helpful_description(module):
    values = flags.FlagValues()
    module.define_flags(values)
    assert len(values) >= 4
    for name in values:
        assert len(values[name].help) >= 25, f"{module.__name__} --{name}: {values[name].help!r}"


def test_suite_help_lists_its_flags():
    result = subprocess.run([sys.executable, "-m", "transformer_jax.benchmarks", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)  # absl's --help exits 1
    assert "Traceback" not in result.stderr, result.stderr
    for flag in ("--train_presets", "--decode_presets", "--peak_repeats", "--skip_attention"):
        assert flag in result.stdout


def test_train_step_and_decoding_records_from_known_times(monkeypatch):
    """With the timed runs' seconds fixed at 0.5, 0.25 and 1.0, the records report median 0.5, best 0.25
    and rates of the tokens they count: 3 x 5 target tokens a step, 3 x 4 generated tokens a search."""
    peak = timing.matmul_peak(2, size=64)
    def known_times(fn, repeats):
        fn()
        return [0.5, 0.25, 1.0]

    monkeypatch.setattr(timing, "time_calls", known_times)
    record = train_step.bench_train_step("micro", presets.TrainPreset(MICRO, batch=3, length=5), peak,
                                         dtype="float32", repeats=3)
    assert record["measured"] == "train_step_float32" and record["peak_best_gflops"] > 0
    assert (record["median_s"], record["best_s"], record["target_tokens_per_s"]) == (0.5, 0.25, 30.0)
    assert record["params"] > 0
    (greedy,) = decoding.bench_decode("micro", MICRO_DECODE, peak, kind="greedy", new_tokens=[4], repeats=3)
    assert greedy["measured"] == "decode_greedy_cached" and "mfu" in greedy
    assert (greedy["median_s"], greedy["best_s"], greedy["generated_tokens_per_s"]) == (0.5, 0.25, 24.0)


def test_attention_memory_run(capsys):
    records = attention.run([16, 32], block_size=16, skip_timing=True, max_dense_seconds=1.0)
    assert [(r["impl"], r["length"]) for r in records] == [
        ("dense", 16), ("blockwise", 16), ("dense", 32), ("blockwise", 32)]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[-1]["summary"] == "peak_memory_ratio" and lines[-1]["length"] == 32


def test_profile_summary_counts_nested_ops_once():
    # A while loop (0-100 ns) runs two fusions (10-40, 50-70); a copy (120-130) runs after it. Another
    # thread runs a fusion at the same time as the loop: its own line, not nested in the loop.
    events = [profile.OpEvent("while.3", "t0", 0, 100), profile.OpEvent("fusion.1", "t0", 10, 40),
              profile.OpEvent("fusion.2", "t0", 50, 70), profile.OpEvent("copy.7", "t0", 120, 130),
              profile.OpEvent("fusion.9", "t1", 20, 60)]
    rows = {r["op"]: r for r in profile.summarize(events)}
    assert {op: (r["calls"], round(r["exclusive_ms"] * 1e6)) for op, r in rows.items()} == {
        "while": (1, 50), "fusion": (3, 90), "copy": (1, 10)}
    assert rows["fusion"]["share"] == pytest.approx(90 / 150, abs=1e-4)
    assert [r["op"] for r in profile.summarize(events)] == ["fusion", "while", "copy"]


def test_profile_of_a_traced_decode(tmp_path):
    record = profile.profile_decode("micro", MICRO_DECODE, "greedy", beam_size=1, repeats=1,
                                    trace_dir=str(tmp_path))
    ops = {r["op"]: r for r in record["ops"]}
    assert "while" in ops and ops["while"]["calls"] >= 1  # the decoding loop ran and was traced
    assert sum(r["share"] for r in record["ops"]) == pytest.approx(1.0, abs=1e-3)
    assert 0 < record["op_ms_per_step"] <= record["traced_wall_ms_per_step"]
    assert record["ops_per_step"] > 1
    everything = profile.read_op_events(str(tmp_path))
    assert profile.read_op_events(str(tmp_path), "/host:CPU") == everything  # XLA:CPU runs ops there
    assert profile.read_op_events(str(tmp_path), "/device:") == []


def test_profile_of_a_folder_without_a_trace_says_so(tmp_path):
    with pytest.raises(MissingFileError, match="no \\*.xplane.pb under"):
        profile.read_op_events(str(tmp_path))


def test_data_benchmark_times_both_paths_on_a_scaled_corpus(tmp_path):
    """A 300-pair corpus from 7 lines: pair k joins lines k and 7k + 3 (mod 7). The cache's warm start
    finds its entries; the in-memory path encodes again; both draw the same pairs."""
    source = tmp_path / "source"
    source.mkdir()
    for lang in ("en", "de"):
        for split in ("train", "val", "test"):
            text = "".join(f"{lang} line number {i} of seven\n" for i in range(7))
            (source / f"{split}.{lang}").write_text(text)
    corpus = data.scaled_corpus(source, tmp_path / "corpus", 300)
    lines = (corpus / "train.de").read_text().splitlines()
    assert len(lines) == 300  # pair 9 joins lines 9 % 7 = 2 and (63 + 3) % 7 = 3
    assert lines[9] == "de line number 2 of seven de line number 3 of seven"
    result = subprocess.run(
        [sys.executable, "-m", "transformer_jax.benchmarks.data", f"--data_dir={source}", "--pairs=300",
         f"--workdir={tmp_path}", "--vocab_size=30", "--tokens_per_batch=256", "--batches=3"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    starts = {(r["path"], r["start"]): r for r in records if r["record"] == "start"}
    assert len(starts) == 4 and {r["pairs"] for r in starts.values()} == {300}
    assert all(r["seconds_to_first_batch"] > 0 and r["peak_rss_gb"] > 0 for r in starts.values())
    assert records[-1]["record"] == "h100_base_model" and records[-1]["batches_per_s"] > 0
    assert len([p for p in (tmp_path / "cache-cache" / "encoded").iterdir() if p.is_dir()]) == 1


def test_the_peaks_matmul_is_large_enough_for_the_backend():
    """On an accelerator a 2048^3 matmul is mostly dispatch (a low peak, a high MFU): 8192^3 there."""
    assert timing.peak_size("cpu") == 2048
    assert timing.peak_size("gpu") == timing.peak_size("tpu") == 8192


@pytest.mark.parametrize("dtype, backend, capability, precision, named", [
    ("float32", "gpu", "9.0", None, "float32 at JAX's default precision: TF32 multiplies on this GPU "
                                    "(compute capability 9.0)"),
    ("float32", "gpu", "8.0", "tensorfloat32", "float32 at matmul precision 'tensorfloat32': TF32"),
    ("float32", "tpu", None, None, "float32 at JAX's default precision: bfloat16 passes on a TPU"),
    ("float32", "gpu", "9.0", "highest", ""), ("float32", "gpu", "7.0", None, ""),
    ("float32", "cpu", None, None, ""), ("bfloat16", "gpu", "9.0", None, "")])
def test_a_float32_peak_is_labelled_with_what_it_multiplies_in(dtype, backend, capability, precision, named):
    label = timing.precision_label(dtype, backend=backend, compute_capability=capability, precision=precision)
    assert label.startswith(named) if named else label == ""
    peak = timing.Peak(best_flops=1e14, median_flops=9e13, dtype=dtype, size=8192, repeats=3, precision=label)
    assert peak.label == (label or dtype) and peak.record()["precision"] == peak.label
