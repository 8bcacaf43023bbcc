"""The wheelhouse for an offline node: the plan (what the node's freeze list leaves out) offline, and the
whole path (build for a Python, install into a fresh venv with --no-index, import) where pip can download."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
from test_output_file import unwritable_folders

from transformer_jax import wheelhouse
from transformer_jax.runtime import errors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NODE_FREEZE = """\
# the site's modules
jax==0.11.0
jaxlib==0.11.0+cuda13
Flax==0.13.1
orbax_checkpoint==0.13.0
sentencepiece @ file:///site/wheels/sentencepiece-0.2.3-cp312-cp312-linux_x86_64.whl
-e git+https://example.invalid/tool.git#egg=tool

tqdm===4.70.1
"""


def test_parse_freeze_names_versions_and_constraints():
    have = wheelhouse.parse_freeze(NODE_FREEZE)
    assert set(have) == {"jax", "jaxlib", "flax", "orbax-checkpoint", "sentencepiece", "tqdm"}
    assert have["flax"].version == "0.13.1"
    assert have["jaxlib"].constraint() == "jaxlib==0.11.0"  # the site's +cuda13 label is not on an index
    assert have["sentencepiece"].version is None and have["sentencepiece"].constraint() is None
    assert have["tqdm"].constraint() == "tqdm==4.70.1"


def test_parse_freeze_names_a_bad_line():
    with pytest.raises(errors.DataError, match=r"node.txt, line 2: expected name==version.*'jax>=0.10'"):
        wheelhouse.parse_freeze("flax==0.12\njax>=0.10\n", "node.txt")


def test_plan_leaves_out_what_the_node_has_by_normalized_name():
    resolved = {"jax": "0.11.0", "flax": "0.13.1", "ml-collections": "1.1.0", "sacremoses": "0.2.0",
                "tensorflow-datasets": "4.9.10", "transformer-jax": "0.1.0", "orbax-checkpoint": "0.13.0"}
    have = wheelhouse.parse_freeze("JAX==0.11.0\nflax==0.13.1\nOrbax_Checkpoint==0.13.0\nscipy==1.17\n")
    plan = wheelhouse.plan(resolved, have)
    assert plan.download == {"ml-collections": "1.1.0", "sacremoses": "0.2.0",
                             "tensorflow-datasets": "4.9.10", "transformer-jax": "0.1.0"}
    assert plan.skipped == {"jax": "0.11.0", "flax": "0.13.1", "orbax-checkpoint": "0.13.0"}


def test_requires_python_is_checked_against_the_node_python():
    assert wheelhouse.takes_python(">=3.12", "3.12") and wheelhouse.takes_python(None, "3.12")
    assert not wheelhouse.takes_python(">=3.13", "3.12")
    assert not wheelhouse.takes_python(">=3.8,<3.12", "3.12")


def test_platform_tags_cover_the_older_manylinux_and_refuse_nonsense():
    tags = wheelhouse.platform_tags("2.28", "x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert tags[-1] == "manylinux2014_x86_64" and "manylinux_2_29_x86_64" not in tags
    assert wheelhouse.platform_tags("2.34", "aarch64")[0] == "manylinux_2_34_aarch64"
    with pytest.raises(errors.ConfigError, match="--glibc=2.5"):
        wheelhouse.platform_tags("2.5", "x86_64")
    with pytest.raises(errors.ConfigError, match="--python-version=3.10"):
        wheelhouse.check_python_version("3.10")


def _fake_pip(calls: list, report: dict, missing_first: str | None = None, too_new: tuple | None = None):
    """A stand-in for ``wheelhouse._pip`` that records its calls and writes pip's dry-run report;
    ``too_new`` = (name, version): a release needing Python 3.13, resolved until it is excluded."""

    def pip(args, what):
        calls.append(args)
        if args[0] == "install":
            constraints = open(args[args.index("-c") + 1]).read()
            if missing_first and f"{missing_first}==" in constraints:
                raise wheelhouse.PipError("no", f"ERROR: No matching distribution found for {missing_first}"
                                                "==0.11.0")
            rows = [{"metadata": {"name": n, "version": v}} for n, v in report.items()]
            if too_new and f"{wheelhouse.canonical(too_new[0])}!={too_new[1]}" not in constraints:
                rows = [{"metadata": {"name": too_new[0], "version": too_new[1], "requires_python": ">=3.13"}}
                        if r["metadata"]["name"] == too_new[0] else r for r in rows]
            with open(args[args.index("--report") + 1], "w") as f:
                json.dump({"install": rows}, f)
        elif args[0] == "wheel":
            name = "transformer_jax-0.1.0" if args[-1] == ROOT else f"{args[-1]}-1.0"
            open(os.path.join(args[args.index("--wheel-dir") + 1], f"{name}-py3-none-any.whl"), "w").close()
        elif args[0] == "download":
            dest = args[args.index("--dest") + 1]
            for pin in args[args.index("--dest") + 2:]:
                open(os.path.join(dest, pin.replace("==", "-") + "-py3-none-any.whl"), "w").close()
        return subprocess.CompletedProcess(args, 0)

    return pip


def test_build_downloads_only_what_the_node_lacks_and_always_the_project(tmp_path, monkeypatch):
    report = {"transformer_jax": "0.1.0", "jax": "0.11.0", "jaxlib": "0.11.0", "ml_collections": "1.1.0",
              "promise": "2.3"}
    calls = []
    monkeypatch.setattr(wheelhouse, "_pip", _fake_pip(calls, report, missing_first="jaxlib",
                                                      too_new=("ml_collections", "9.0")))
    have = wheelhouse.parse_freeze("jax==0.11.0\njaxlib==0.11.0+site\ntransformer_jax==0.0.9\n")
    lines = []
    plan = wheelhouse.build(python_version="3.12", out=str(tmp_path / "wh"), have=have, say=lines.append)
    assert plan.download == {"ml-collections": "1.1.0", "promise": "2.3", "transformer-jax": "0.1.0"}
    assert plan.unpinned == ("jaxlib",)  # a site build: pip could not find it, so it pins nothing
    resolutions = [c for c in calls if c[0] == "install"]
    assert all("--ignore-requires-python" in c for c in resolutions)  # pip would check its own Python
    assert len(resolutions) == 3  # jaxlib unpinned, then ml_collections 9.0 (Python >= 3.13) excluded
    download = next(c for c in calls if c[0] == "download")
    assert download[-2:] == ["ml-collections==1.1.0", "promise==2.3"]
    assert "--python-version=3.12" in download and "--platform=manylinux_2_28_x86_64" in download
    assert sorted(os.listdir(tmp_path / "wh")) == ["ml-collections-1.1.0-py3-none-any.whl",
                                                   "promise-2.3-py3-none-any.whl",
                                                   "transformer_jax-0.1.0-py3-none-any.whl"]
    assert any(line.startswith(f"{tmp_path / 'wh'}: 3 wheels") for line in lines)
    assert any("left out, the node has them: jax, jaxlib" in line for line in lines)


def test_an_out_folder_that_cannot_be_written_is_one_line_before_anything_is_built(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(wheelhouse, "_pip", _fake_pip(calls, {"transformer_jax": "0.1.0"}))
    with unwritable_folders(tmp_path) as cases:
        for folder, reason in cases:
            with pytest.raises(errors.ConfigError) as error:
                wheelhouse.build(python_version="3.12", out=folder, have={}, say=print)
            assert str(error.value) == f"--out={folder}: {reason}; choose another --out"
    assert calls == []


def test_cli_missing_freeze_file_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "transformer_jax.wheelhouse", "--python-version=3.12",
                           f"--out={tmp_path}", f"--have={tmp_path}/nope.txt"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert "nope.txt: no such file; make it on the node with python -m pip list" in done.stderr
    assert "Traceback" not in done.stderr


def _node_python() -> tuple[str, str]:
    """(a Python 3.12 interpreter if this machine has one that runs, else this one; its version as 3.N)."""
    pyenv = glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3"))
    candidates = [shutil.which("python3.12"), *pyenv]
    code = "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"
    for python in [c for c in candidates if c] + [sys.executable]:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True)
        if done.returncode == 0:  # a pyenv shim of a version not selected here exits 127
            return python, done.stdout.strip()
    raise AssertionError("unreachable: this interpreter runs")


def _pip_can_download(tmp_path, version: str) -> bool:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           "--only-binary=:all:", f"--python-version={version}",
                           "--platform=manylinux2014_x86_64", "--dest", str(tmp_path / "probe"), "absl-py"],
                          capture_output=True, text=True, timeout=120)
    return done.returncode == 0


@pytest.mark.slow
def test_wheelhouse_installs_offline_into_a_fresh_venv(tmp_path):
    """The whole path, as on a node that has nothing: about 280 MB and 3 minutes, so it runs only when asked
    (TRANSFORMER_JAX_NETWORK_TESTS=1): the suite's budget has no room for it."""
    if os.environ.get("TRANSFORMER_JAX_NETWORK_TESTS") != "1":
        pytest.skip("downloads about 280 MB: set TRANSFORMER_JAX_NETWORK_TESTS=1 to run it")
    python, version = _node_python()
    if not _pip_can_download(tmp_path, version):
        pytest.skip("pip cannot download here (no package index reachable): the wheelhouse needs one")
    out = tmp_path / "wheelhouse"
    subprocess.run([sys.executable, "-m", "transformer_jax.wheelhouse", f"--python-version={version}",
                    f"--out={out}"], check=True, cwd=ROOT)
    assert glob.glob(str(out / "transformer_jax-*.whl")) and glob.glob(str(out / "jaxlib-*.whl"))
    venv = tmp_path / "node"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # nothing but the wheelhouse: no index, no find-links from config
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index",
                    f"--find-links={out}", "transformer_jax"], check=True, env=env)
    code = "import transformer_jax.training.loop, transformer_jax; print(transformer_jax.__file__)"
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert str(venv) in done.stdout
