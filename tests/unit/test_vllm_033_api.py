"""Our loaders against vLLM 0.33's model-loader API, read from its source (tests/data/vllm_0_33)."""

import ast
import inspect
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm_fastload.ipc.engine.loader import IpcCacheLoader  # noqa: E402
from vllm_fastload.streaming.loader import RunaiStreamerLoader  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "data" / "vllm_0_33"


def _class(tree, name):
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def test_register_model_loader_takes_a_load_format_name():
    tree = ast.parse((SRC / "__init__.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "register_model_loader")
    assert [a.arg for a in fn.args.args] == ["load_format"]


@pytest.mark.parametrize("cls", [RunaiStreamerLoader, IpcCacheLoader])
def test_our_loaders_implement_the_033_base_class(cls):
    base = _class(ast.parse((SRC / "base_loader.py").read_text()), "BaseModelLoader")
    methods = {f.name: f for f in base.body if isinstance(f, ast.FunctionDef)}
    abstract = [n for n, f in methods.items()
                if any(getattr(d, "id", None) == "abstractmethod" for d in f.decorator_list)]
    assert sorted(abstract) == ["download_model", "load_weights"]
    for name in abstract:
        assert name in vars(cls), f"{cls.__name__} does not implement {name}"
    for name, f in methods.items():
        if name.startswith("_") and name != "__init__":
            continue
        ours = inspect.signature(getattr(cls, name))
        var = any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ours.parameters.values())
        for arg in [a.arg for a in f.args.args][1:]:
            assert var or arg in ours.parameters, f"{cls.__name__}.{name} lacks parameter {arg!r} of vLLM 0.33"


def test_ipc_cache_accepts_the_is_draft_key_033_passes():
    from vllm.config.load import LoadConfig

    draft = LoadConfig(load_format="ipc_cache", model_loader_extra_config={"is_draft": True})
    assert IpcCacheLoader(draft).config.is_draft
