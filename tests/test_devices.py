"""Tests for transformer_jax.runtime.devices: a run that asks for an accelerator never lands on the CPU."""

import os

import pytest

from configs import default as default_config
from transformer_jax import run_config
from transformer_jax.runtime import devices
from transformer_jax.runtime.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("wanted, backend", [
    ("any", "cpu"), ("any", "gpu"), ("accelerator", "gpu"), ("accelerator", "tpu"), ("gpu", "gpu"),
    ("tpu", "tpu")])
def test_the_device_asked_for_passes(wanted, backend):
    assert devices.check_platform(wanted, backend=backend, cuda_plugin=None) is None


@pytest.mark.parametrize("wanted, backend, install", [
    ("gpu", "cpu", [devices.INSTALL["gpu"]]), ("tpu", "cpu", [devices.INSTALL["tpu"]]),
    ("tpu", "gpu", [devices.INSTALL["tpu"]]), ("accelerator", "cpu", list(devices.INSTALL.values()))])
def test_a_missing_device_is_one_line_with_the_install_command(wanted, backend, install):
    with pytest.raises(ConfigError) as error:
        devices.check_platform(wanted, backend=backend, cuda_plugin=None)
    message = str(error.value)
    assert "\n" not in message and f"config.platform={wanted!r}" in message
    assert f"only {backend} devices" in message and "--config.platform=any" in message
    for line in install:
        assert line in message


def test_a_cuda_plugin_that_did_not_load_is_named():
    with pytest.raises(ConfigError, match=r"jax-cuda12-plugin 0\.10\.2\) is installed but did not load"):
        devices.check_platform("gpu", backend="cpu", cuda_plugin="0.10.2")
    notice = devices.check_platform("any", backend="cpu", cuda_plugin="0.10.2")  # not silent either
    assert notice.startswith("notice: ") and "fell back to the CPU" in notice and "\n" not in notice


def test_an_unknown_platform_is_refused_by_the_check_and_the_config():
    with pytest.raises(ConfigError, match="config.platform='cuda': expected one of 'any'"):
        devices.check_platform("cuda", backend="gpu", cuda_plugin=None)
    config = default_config.get_config()
    config.platform = "cuda"
    with pytest.raises(ConfigError, match=r"config\.platform='cuda'"):
        run_config.build_run_config(config, environment=False)


def test_small_configs_run_anywhere_and_wmt_configs_ask_for_an_accelerator():
    from configs import multi30k, wmt14_en_de_base, wmt14_en_de_big, wmt14_en_fr_big
    assert default_config.get_config().platform == multi30k.get_config().platform == "any"
    for module in (wmt14_en_de_base, wmt14_en_de_big, wmt14_en_fr_big):
        assert module.get_config().platform == "accelerator", module.__name__
    assert run_config.build_run_config(default_config.get_config(), environment=False).loop.platform == "any"


def test_a_site_cuda13_plugin_that_did_not_load_is_named(monkeypatch):
    versions = {"jax-cuda13-plugin": "0.11.0"}  # a site's JAX for CUDA 13; no cuda12 plugin
    monkeypatch.setattr(devices, "installed_version", versions.get)
    with pytest.raises(ConfigError, match=r"\(jax-cuda13-plugin 0\.11\.0\) is installed but did not load"):
        devices.check_platform("gpu", backend="cpu")
