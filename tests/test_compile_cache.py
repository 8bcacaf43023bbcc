"""The persistent compilation cache of translate and evaluate.py (runtime/compile_cache.py)."""

import jax

from transformer_jax.runtime import compile_cache


def test_enable_sets_the_folder_unless_the_environment_decides(tmp_path, monkeypatch):
    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        assert compile_cache.enable("") is None
        assert jax.config.jax_compilation_cache_dir == before
        assert compile_cache.enable(str(tmp_path)) == str(tmp_path)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
        jax.config.update("jax_compilation_cache_dir", before)
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")  # set, empty: off (as the test suite runs)
        assert compile_cache.enable(str(tmp_path)) is None
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
        assert compile_cache.enable(str(tmp_path)) == "/elsewhere"
        assert jax.config.jax_compilation_cache_dir == before  # jax reads the variable itself
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
