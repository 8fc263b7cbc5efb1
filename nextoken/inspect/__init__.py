"""The inspector: every stage of inference on the loaded model (the page at ``/inspect``).

Each module computes the numbers of some widgets as plain JSON-ready data; `routes` serves them
under ``/inspect/api/`` and the page (``static/``) only draws them:

- `text`: tokens as typed, the BPE merge replay, the embedding map and the analogy;
- `model_view`: RoPE tables, the sinusoidal encoding, the architecture, the stored formats and
  the re-quantization error;
- `trace`: the views of one traced prompt (a `trace.recorder.TraceRecorder`, run as a request of
  the engine in its own forward pass): the head labels, the attention maps, the logit lens;
- `engine_view`: the sampler's stages, the beam-search tree, the KV cache figures and the live
  state of the engine (block pool, batches, speculation, recent requests).
"""
