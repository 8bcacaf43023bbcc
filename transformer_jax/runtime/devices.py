"""The device a run asks for (``config.platform``) against the one JAX found: no silent CPU run.

JAX picks its backend when it starts: the GPU through the CUDA plugin (the ``cuda12`` extra), the TPU
through libtpu (the ``tpu`` extra), else the CPU. With no plugin, or a plugin that fails to load (a
driver too old, CUDA libraries missing), it falls back to the CPU with only a log warning, and a WMT run
would train for months there. ``check_platform`` turns that into one line before anything is read:

    config.platform   "any"          run wherever JAX runs (the small configs)
                      "accelerator"  a GPU or a TPU (the WMT configs)
                      "gpu", "tpu"   that one

With ``"any"``, a CUDA plugin that is installed but did not load still gets a one-line notice.
"""

from __future__ import annotations

import importlib.metadata

import jax

from transformer_jax.runtime.errors import ConfigError

PLATFORMS = ("any", "accelerator", "gpu", "tpu")
INSTALL = {"gpu": 'pip install -c constraints.txt -e ".[cuda12]"',
           "tpu": 'pip install -c constraints.txt -e ".[tpu]"'}
CUDA_PLUGIN = "jax-cuda12-plugin"
CUDA_PLUGINS = (CUDA_PLUGIN, "jax-cuda13-plugin")  # the cuda12 extra's, and CUDA 13's (a site's JAX)
_LOOK_UP = "look up"  # check_platform's default: ask importlib.metadata


def installed_version(distribution: str) -> str | None:
    """The installed version of a pip distribution, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _accepts(wanted: str, backend: str) -> bool:
    return wanted == "any" or backend == wanted or (wanted == "accelerator" and backend in ("gpu", "tpu"))


def check_platform(wanted: str, *, backend: str | None = None,
                   cuda_plugin: str | None = _LOOK_UP) -> str | None:
    """Raises ConfigError, in one line with the install command, when JAX's backend is not ``wanted``.

    Args:
      wanted: ``config.platform``, one of ``PLATFORMS``.
      backend: JAX's default backend ("cpu", "gpu", "tpu"); default: ask JAX (this starts it).
      cuda_plugin: the installed JAX CUDA plugin's version, or None for none; default: look up
        ``CUDA_PLUGINS`` (CUDA 12's or 13's).

    Returns:
      A one-line notice when ``wanted`` is "any" but an installed CUDA plugin did not load, else None.
    """
    if wanted not in PLATFORMS:
        raise ConfigError(f"config.platform={wanted!r}: expected one of {', '.join(map(repr, PLATFORMS))}")
    backend = backend or jax.default_backend()
    plugin_name = CUDA_PLUGIN
    if cuda_plugin is _LOOK_UP:
        plugin_name, cuda_plugin = next(((n, v) for n in CUDA_PLUGINS if (v := installed_version(n))),
                                        (CUDA_PLUGIN, None))
    fell_back = backend == "cpu" and cuda_plugin is not None
    why = (f"the CUDA plugin ({plugin_name} {cuda_plugin}) is installed but did not load, so JAX fell back "
           "to the CPU (python -c \"import jax; jax.devices('cuda')\" shows why: driver, CUDA libraries)"
           if fell_back else f"JAX found no {'accelerator' if wanted == 'accelerator' else wanted.upper()}, "
           f"only {backend} devices")
    if _accepts(wanted, backend):
        return f"notice: {why}; training on the CPU" if fell_back else None
    installs = [INSTALL["gpu"], INSTALL["tpu"]] if wanted == "accelerator" else [INSTALL[wanted]]
    raise ConfigError(f"config.platform={wanted!r} but {why}; install the plugin with: "
                      f"{' (NVIDIA GPU) or '.join(installs)}{' (TPU)' if wanted == 'accelerator' else ''}, "
                      "or set --config.platform=any to run here anyway")
