"""Write a random Llama-shaped bf16 safetensors checkpoint (no tokenizer), for benchmarks and GPU tests.

    python benchmarks/make_model.py OUT --shape 8b      # Llama-3-8B shape, ~16 GB in 4 shards
    python benchmarks/make_model.py OUT --shape 1b      # Llama-3.2-1B's layers, untied, ~3.0 GB (a cold cache on CPU)
    python benchmarks/make_model.py OUT --shape small   # 8 layers, ~0.4 GB (KV accounting tests)
    python benchmarks/make_model.py OUT --shape tiny    # 2 layers, ~20 MB, for correctness tests
    python benchmarks/make_model.py OUT --shape deep    # 2444 layers, 22,003 tensors, ~0.5 GB (per-tensor costs)
    python benchmarks/make_model.py OUT --shape deep1k  # the same layers: 111 of them, ~1k tensors
    python benchmarks/make_model.py OUT --shape deep100k  # 11,111 of them, ~100k tensors, ~2.2 GB

Weights are drawn on the GPU when there is one (fast), scaled small so greedy decoding is well defined.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, shards=4),
    # Llama-3.2-1B's layer shapes with untied embeddings, 3.0 GB bf16: big tensors a CPU host can hold (cold reads)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, shards=2),
    "small": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000, shards=2),
    # 22,003 tensors of 0.25-32 KiB: the per-tensor costs of a load (issue 28: "many tensors"), 0.5 GB
    "deep": dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2444, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=4096, shards=2),
    # the same layers, as many as give ~1k and ~100k tensors (the other two sizes of issue 28's target)
    "deep1k": dict(hidden_size=128, intermediate_size=128, num_hidden_layers=111, num_attention_heads=2,
                   num_key_value_heads=1, vocab_size=4096, shards=1),
    "deep100k": dict(hidden_size=128, intermediate_size=128, num_hidden_layers=11111, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=4096, shards=4),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096, shards=2),
}


def tensors_of(s: dict) -> dict[str, tuple]:
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * s["hidden_size"] // s["num_attention_heads"]
    out = {"model.embed_tokens.weight": (s["vocab_size"], h), "model.norm.weight": (h,),
           "lm_head.weight": (s["vocab_size"], h)}
    for layer in range(s["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
    return out


def make(out: Path, shape: str, seed: int = 0) -> Path:
    """Write config.json, model-0000k-of-0000n.safetensors and the index into ``out``; returns ``out``. A model
    already there (its index is written last) is kept when its config.json has ``shape``'s sizes; raises
    ``ValueError`` naming the directory and the first differing field when it has another shape (a benchmark
    would otherwise measure the wrong model)."""
    s = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.safetensors.index.json").exists():
        try:
            have = json.loads((out / "config.json").read_text())
        except (OSError, ValueError):
            have = {}
        for k, v in s.items():
            if k != "shards" and have.get(k) != v:
                raise ValueError(f"{out} holds a model of another shape than {shape!r} ({k}: {have.get(k)!r} there, "
                                 f"{v!r} asked); remove the directory or name another")
        return out
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    names = tensors_of(s)
    n = s["shards"]
    groups = [list(names)[k::n] for k in range(n)]
    weight_map = {}
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        ts = {}
        for name in group:
            shp = names[name]
            if name.endswith("norm.weight"):
                t = torch.ones(shp, device=dev) + 0.01 * torch.randn(shp, generator=g, device=dev)
            else:
                t = torch.randn(shp, generator=g, device=dev) * (1.0 / shp[-1] ** 0.5)
            ts[name] = t.to(torch.bfloat16).cpu()
            weight_map[name] = fname
        save_file(ts, str(out / fname), metadata={"format": "pt"})
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        **{k: v for k, v in s.items() if k != "shards"},
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    a = ap.parse_args()
    print(make(a.out, a.shape))
    os.sync()
