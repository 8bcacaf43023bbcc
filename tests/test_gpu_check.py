"""The GPU check: --quick runs every step on this CPU; a dropped mask in the fused path turns step 3 red; a
failing, hanging or impossible step is a row that says why, and the next step runs."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_output_file import unwritable_folders

from transformer_jax.benchmarks import gpu_check, gpu_check_runs, gpu_check_steps
from transformer_jax.model import fused_attention
from transformer_jax.runtime.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quick_runs_every_step_and_writes_the_table(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, "-m", "transformer_jax.benchmarks.gpu_check", "--quick",
                           f"--out={out}"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out / "gpu_check.json") as f:
        report = json.load(f)
    assert [s["name"] for s in report["steps"]] == list(gpu_check.STEPS)
    assert [s["status"] for s in report["steps"]] == ["pass"] * 6, report["steps"]
    assert report["all_passed"] and report["quick"]
    table = done.stdout[done.stdout.index(" #  step"):]
    assert len([line for line in table.splitlines() if "  pass  " in line]) == 6
    train = report["steps"][4]["details"]
    assert train["losses"][-1][1] < train["losses"][0][1]  # the loss went down
    assert {"greedy", "beam"} <= set(train["test"])
    assert "| 3 | fused attention | pass |" in (out / "gpu_check.md").read_text()
    assert sorted(os.listdir(out / "logs"))[:6] == ["1-devices.json", "1-devices.log", "2-matmul_peak.json",
                                                    "2-matmul_peak.log", "3-fused_attention.json",
                                                    "3-fused_attention.log"]


def _drop_mask(original):
    def fused(query, key, value, mask=None, **kwargs):
        return original(query, key, value, None, **kwargs)  # the planted bug: the mask is lost

    return fused


def test_fused_attention_step_passes_and_a_dropped_mask_fails_it(monkeypatch, tmp_path):
    options = gpu_check.Options(out=str(tmp_path), quick=True)
    row = gpu_check.run_step("fused_attention", options, {})
    assert row.status == gpu_check.PASS, row.summary
    worst = max(v for case in row.details["cases"] for v in case["fused"].values())
    assert worst <= gpu_check_steps.VALUE_TOLERANCE

    monkeypatch.setattr(fused_attention, "fused_attention", _drop_mask(fused_attention.fused_attention))
    row = gpu_check.run_step("fused_attention", options, {})
    assert row.status == gpu_check.FAIL
    assert row.summary.startswith("fused attention differs from dense: encoder self, padding: values")
    assert row.details["cases"][0]["fused"]["values"] > 0.1  # of order 1, not a rounding error


def test_a_failing_step_is_a_row_and_the_next_one_runs(monkeypatch, tmp_path):
    def boom(options, earlier):
        raise RuntimeError("the device fell off the bus")

    monkeypatch.setitem(gpu_check.STEP_FUNCTIONS, "devices", boom)
    monkeypatch.setitem(gpu_check.STEP_FUNCTIONS, "matmul_peak", lambda options, earlier: ("12 TFLOP/s", {}))
    options = gpu_check.Options(out=str(tmp_path), quick=True)
    lines = []
    rows = gpu_check.run_checks(options, only=("devices", "matmul_peak"), isolate=False, say=lines.append)
    assert [(r.status, r.summary) for r in rows[:2]] == [
        ("fail", "RuntimeError: the device fell off the bus"), ("pass", "12 TFLOP/s")]
    assert all(r.status == "not run" and r.summary == "left out by --only" for r in rows[2:])
    assert not gpu_check.all_passed(rows)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["status"] for s in report["steps"]] == ["fail", "pass"] + ["not run"] * 4


def test_an_out_folder_that_cannot_be_written_is_one_line_before_any_step(monkeypatch, tmp_path):
    ran, lines = [], []
    monkeypatch.setitem(gpu_check.STEP_FUNCTIONS, "devices",
                        lambda options, earlier: ran.append(1) or ("", {}))
    with unwritable_folders(tmp_path) as cases:
        for folder, reason in cases:
            with pytest.raises(ConfigError) as error:
                gpu_check.run_checks(gpu_check.Options(out=folder, quick=True), only=("devices",),
                                     isolate=False, say=lines.append)
            assert str(error.value) == f"--out={folder}: {reason}; choose another --out"
    assert ran == lines == []


def test_a_step_past_its_time_box_fails_in_process_and_isolated(monkeypatch, tmp_path):
    monkeypatch.setitem(gpu_check.STEP_FUNCTIONS, "devices", lambda options, earlier: time.sleep(30))
    options = gpu_check.Options(out=str(tmp_path), quick=True, time_boxes={"devices": 0.2})
    row = gpu_check.run_step("devices", options, {})
    assert (row.status, row.summary) == ("fail", "did not finish within its 0.2 s time box")
    # Isolated: the child process (Python, absl and JAX starting take longer than this) is killed.
    row = gpu_check.run_isolated("devices", options, {})
    assert row.status == "fail"
    assert row.summary.startswith("did not finish within its 0.2 s time box (killed)")


def _step_process(out) -> int | None:
    """The pid of a running (not zombie) step process of the check writing to ``out``, if any."""
    for entry in os.listdir("/proc"):
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        ours = f"--out={out}".encode() in command and any(a.startswith(b"--step=") for a in command)
        if ours and state != "Z":
            return int(entry)
    return None


def test_ctrl_c_ends_the_steps_process_and_is_one_line(tmp_path):
    out = tmp_path / "check"
    check = subprocess.Popen([sys.executable, "-m", "transformer_jax.benchmarks.gpu_check", "--quick",
                              "--only=5", f"--out={out}"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    step = None
    try:
        began = time.monotonic()
        while step is None and check.poll() is None and time.monotonic() - began < 60:
            step = _step_process(out)
            time.sleep(0.05)
        assert step is not None, "the step's process did not start"
        check.send_signal(signal.SIGINT)  # what Ctrl-C sends; the step, in its own session, gets none
        stdout, stderr = check.communicate(timeout=60)
        assert check.returncode == 128 + signal.SIGINT, stdout + stderr
        assert "Traceback" not in stdout + stderr and stderr == "", stderr
        assert stdout.splitlines()[-1] == (
            f"Stopped by SIGINT at step 5 (train and decode): its process was ended; the steps before it are "
            f"in {out / 'gpu_check.md'}. Run the same command again to check again.")
        assert _step_process(out) is None  # ended, not left running
        report = json.loads((out / "gpu_check.json").read_text())
        assert [(s["status"], s["summary"]) for s in report["steps"][4:]] == [
            ("fail", "stopped by SIGINT before it finished (its process was ended)"),
            ("not run", "stopped by SIGINT before it started")]
    finally:
        if check.poll() is None:
            check.kill()
            check.wait()
        if step and _step_process(out) == step:  # the old behaviour: the step ran on after the check died
            os.kill(step, signal.SIGKILL)


def test_without_an_accelerator_the_full_check_fails_step_1_and_says_why_for_the_rest(tmp_path):
    options = gpu_check.Options(out=str(tmp_path))
    devices = gpu_check.run_step("devices", options, {})
    assert devices.status == "fail"
    assert "config.platform='gpu' but JAX found no GPU, only cpu devices" in devices.summary
    for name in gpu_check.STEPS[1:]:
        row = gpu_check.run_step(name, options, {"devices": devices})
        assert row.status == "not run", (name, row.summary)
        assert row.summary.startswith("JAX found no accelerator (step 1)")


def test_projection_without_step_4_and_train_without_data_say_why(tmp_path):
    options = gpu_check.Options(out=str(tmp_path), multi30k_dir=str(tmp_path / "none"))
    gpu = {"devices": gpu_check.Row(1, "devices", "pass", "", details={"backend": "gpu"})}
    row = gpu_check.run_step("projection", options, gpu)
    assert row.status == "not run"
    assert row.summary == "it projects step 4's measured step, and step 4 measured none"
    row = gpu_check.run_step("train", options, gpu)
    assert row.status == "fail"
    assert row.summary.startswith(f"no Multi30k in --multi30k_dir={tmp_path / 'none'}")
    assert "python -m transformer_jax.data.prepare multi30k" in row.summary


def test_only_and_version_strings():
    assert gpu_check._parse_only(["3", "train"]) == ("fused_attention", "train")
    assert gpu_check._parse_only([]) == gpu_check.STEPS
    with pytest.raises(ConfigError, match="--only=7: expected step numbers 1-6"):
        gpu_check._parse_only(["7"])
    assert gpu_check_steps._cuda_version_string(12080, cudnn=False) == "12.8"
    assert gpu_check_steps._cuda_version_string(90800, cudnn=True) == "9.8.0"
    assert gpu_check_steps._cuda_version_string(8907, cudnn=True) == "8.9.7"


def test_training_is_stopped_by_sigterm_only_after_it_started(monkeypatch):
    import signal
    import threading

    received, started = [], threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(time.monotonic()))
    try:
        with gpu_check_runs._stop_after(0.3, started.is_set):
            time.sleep(2.5)  # not started: no signal however long it takes
            assert not received
            began = time.monotonic()
            started.set()
            while not received and time.monotonic() - began < 30:
                time.sleep(0.05)
        assert received and received[0] - began >= 0.3
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_crashed_step_is_named_by_its_first_error_line(tmp_path):
    log = tmp_path / "3-fused_attention.log"
    log.write_text("compiling\nLLVM ERROR: Cannot select: v8bf16 = X86ISD::VBROADCAST\n"
                   "Fatal Python error: Aborted\n\nThread 0x7f (most recent call first):\n"
                   "Extension modules: jaxlib.cpu_feature_guard, numpy\n")
    assert gpu_check._last_line(str(log)) == "LLVM ERROR: Cannot select: v8bf16 = X86ISD::VBROADCAST"
    log.write_text("step 1\nstep 2\n")
    assert gpu_check._last_line(str(log)) == "step 2"


@pytest.mark.slow
def test_the_full_training_step_on_text_files_stops_on_time_and_scores_the_test_set(monkeypatch, tmp_path):
    """Step 5 as a GPU runs it (configs/multi30k.py on its text files, stopped by the timer, the test set
    scored greedily and with the beam), with a tiny model and made-up files so that it runs here."""
    rng = __import__("random").Random(0)
    words = [f"w{i}" for i in range(30)]
    data = tmp_path / "multi30k"
    data.mkdir()
    for split, size in (("train", 300), ("val", 12), ("test", 12)):
        sources = [" ".join(rng.choices(words, k=rng.randint(3, 8))) for _ in range(size)]
        (data / f"{split}.en").write_text("".join(s + "\n" for s in sources))
        (data / f"{split}.de").write_text("".join(" ".join(reversed(s.split())) + "\n" for s in sources))
    tiny = ["--config.data.vocab_size=36", "--config.data.length_buckets=(16,32)", "--config.data.max_len=32",
            "--config.data.tokens_per_batch=256", "--config.model.d_model=16", "--config.model.d_ff=32",
            "--config.model.num_heads=2", "--config.model.num_encoder_layers=1",
            "--config.model.num_decoder_layers=1", "--config.train.num_steps=100000",
            "--config.train.warmup_steps=10", "--config.log_every_steps=5", "--config.final_beam_size=2",
            "--config.peak_tflops_per_device=1.0"]
    monkeypatch.setattr(gpu_check_runs, "BASE_ON_MULTI30K", tiny)
    options = gpu_check.Options(out=str(tmp_path / "check"), multi30k_dir=str(data), train_minutes=0.1)
    gpu = {"devices": gpu_check.Row(1, "devices", "pass", "", details={"backend": "gpu"})}
    row = gpu_check.run_step("train", options, gpu)
    assert row.status == "pass", row.summary
    assert row.details["steps"] > 5  # stopped by the timer, not by train.num_steps
    assert {"greedy", "beam"} == set(row.details["test"])
    assert row.details["test"]["beam"]["beam_size"] == 2
    assert os.path.isdir(tmp_path / "check" / "data_cache")  # the data cache stays under --out


# Forms that JAX releases after the pinned one deprecated or removed (their changelogs; SingleDeviceSharding's
# constructor warns on JAX 0.12.1), each with the form that works on both.
REMOVED_OR_DEPRECATED = {
    "jax.sharding.SingleDeviceSharding(": "jax.sharding.make_single_device_sharding(device)",
    "jax.tree_map(": "jax.tree.map",
    "jax.sharding.use_mesh": "jax.set_mesh",
    "with mesh:": "with jax.set_mesh(mesh):",
    "jax.xla_computation": "jax.jit(f).lower(...)",
    "jax.experimental.host_callback": "jax.debug.callback / jax.pure_callback",
    ".device_buffer": ".addressable_shards",
}


def test_the_package_uses_no_jax_api_that_a_newer_jax_deprecated():
    sources = [*Path(ROOT, "transformer_jax").rglob("*.py"), Path(ROOT, "train.py"),
               Path(ROOT, "evaluate.py")]
    found = [f"{path.relative_to(ROOT)}:{number}: {old} (use {new})"
             for path in sources for number, line in enumerate(path.read_text().splitlines(), 1)
             for old, new in REMOVED_OR_DEPRECATED.items()
             if old in line and not line.lstrip().startswith("#")]
    assert not found, found
