"""Hooks that record what each stage of the pipeline did (behind `nextoken explain` and the
inspector, `nextoken.inspect`).

A tracer is attached to one request (``LLMEngine.add_request(..., tracer=)``); the engine runs
that request in a forward pass of its own and calls ``on_prefill_start(ids)``, then per pass
``on_embedding(h, cos, sin)``, ``on_layer(i, h, probs)``, ``on_forward_done(tokens, kv_bytes)``
and ``on_sample(logits, result, params)``. Attention probabilities need the reference attention;
a tracer with ``wants_probs = False`` gets ``probs=None`` and the usual kernels. Requests without
a tracer cost nothing extra.
"""
