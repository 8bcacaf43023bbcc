"""Tests for transformer_jax.runtime.host_memory: freed memory stays in the process (no page faults on reuse).

Each case runs in a fresh interpreter, since malloc settings are process-wide: it mallocs, touches and
frees a 256 MB block five times, and counts the minor page faults of the last four rounds.
"""

import json
import os
import subprocess
import sys

import pytest

from transformer_jax.runtime import host_memory

BLOCK_PAGES = 256 * 2**20 // 4096

SCRIPT = """
import ctypes, ctypes.util, json, resource
from transformer_jax.runtime import host_memory
configured = host_memory.keep_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 256 * 2**20
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    libc.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"configured": configured, "faults": faults}))
"""


def _run(opt_out: bool) -> dict:
    env = dict(os.environ)
    env.pop(host_memory.OPT_OUT_VARIABLE, None)
    if opt_out:
        env[host_memory.OPT_OUT_VARIABLE] = "default"
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory.platform.libc_ver()[0] != "glibc",
                    reason="glibc's mallopt only")
def test_freed_memory_is_reused_without_page_faults():
    kept, default = _run(opt_out=False), _run(opt_out=True)
    assert kept["configured"] and not default["configured"]
    # glibc's defaults: every round maps a fresh block and faults each of its pages in again.
    assert min(default["faults"][1:]) > BLOCK_PAGES // 2
    # Kept: the first round grows the heap; the next ones reuse it.
    assert kept["faults"][0] > BLOCK_PAGES // 2
    assert max(kept["faults"][1:]) < BLOCK_PAGES // 100


@pytest.mark.parametrize("keep", [True, False])
def test_run_main_keeps_freed_memory_unless_the_entry_point_only_decodes(monkeypatch, keep):
    from transformer_jax.runtime import errors

    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append("mallopt"))
    monkeypatch.setattr(errors.app, "run", lambda main, **kwargs: main(["prog"]))
    errors.run_main(lambda argv: calls.append("main"), keep_freed_memory=keep)
    assert calls == (["mallopt", "main"] if keep else ["main"])
