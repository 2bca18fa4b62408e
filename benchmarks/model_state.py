"""What a vLLM engine's model holds, tensor by tensor: the source of ``state(worker)`` for ``LLM.collective_rpc``.

``STATE_SRC`` defines ``state(worker)``: every tensor the worker's model reaches (each module's parameters, buffers
and tensor attributes, under every module path; not the attention layers' ``kv_cache``, the engine's own fresh
memory) as ``name -> [kind, dtype, shape, stride, SHA-256 of its bytes, class, device type]`` ("meta" for a
tensor without memory; the class as ``module.qualname``: vLLM's parameter classes, such as
``ModelWeightParameter``, carry the methods a later ``load_weights`` calls, so an engine whose parameters are of
other classes than ``auto``'s is not the same model even with the same bytes; the device type because a GPU
model may keep some tensors on the host, such as an attention layer's ``_k_scale_cpu`` once vLLM's KV-cache
quantization moved it there, which backends read as host values).
It is source text because the engine pickles the function it runs (cloudpickle, with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``): a function defined in a child's ``__main__`` travels by value, so the
engine's worker needs nothing on its path. Used by ``benchmarks/state_diff.py`` and the GPU tests' engine
(``tests/conftest.py``); two engines whose states are equal hold bit-identical weights.
"""

STATE_SRC = r'''
def state(worker):
    import hashlib
    import torch
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    out = {}
    def put(name, kind, t):
        cls = type(t).__module__ + "." + type(t).__qualname__
        if t.is_meta:
            out[name] = [kind, str(t.dtype), list(t.shape), list(t.stride()), "meta", cls, "meta"]
            return
        raw = t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
        out[name] = [kind, str(t.dtype), list(t.shape), list(t.stride()), hashlib.sha256(raw).hexdigest(), cls,
                     t.device.type]
    with torch.no_grad():
        for mn, m in model.named_modules(remove_duplicate=False):
            p = mn + "." if mn else ""
            for k, v in m._parameters.items():
                if v is not None:
                    put(p + k, "param", v)
            for k, v in m._buffers.items():
                if v is not None:
                    put(p + k, "buffer", v)
            for k, v in vars(m).items():
                if k != "kv_cache" and isinstance(v, torch.Tensor) and k not in m._parameters and k not in m._buffers:
                    put(p + k, "attr", v)
    return out
'''
