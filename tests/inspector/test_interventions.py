"""The inspector's interventions (`layers.attention.Ablation`, `inspect.interventions`): a traced
pass with a head, an attention block or an MLP zero-ablated gives the logits `transformers`
gives with the same component zeroed by PyTorch hooks, on tiny random float32 models of each
architecture; the route reports the change."""

from __future__ import annotations

import pytest
import torch

from nextoken import LLM
from nextoken.layers.attention import Ablation
from nextoken.request_options import RequestOptions
from nextoken.sampling_params import SamplingParams
from nextoken.trace.recorder import TraceRecorder
from tests.tiny_models import tiny_hf_model, write_gguf

PROMPT = [5, 17, 200, 33, 41, 270, 90, 12, 7]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def tiny(request, tmp_path_factory):
    hf = tiny_hf_model(request.param, seed=3)
    path = tmp_path_factory.mktemp("ablate") / f"tiny-{request.param}.gguf"
    write_gguf(hf, path, request.param)
    llm = LLM(str(path), dtype="float32")
    yield hf, llm
    llm.close()


def ours(llm, ablation) -> torch.Tensor:
    tracer = TraceRecorder(llm.engine.config, last_row_only=True)
    tracer.ablation = ablation
    rid = llm.engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1), options=RequestOptions(tracer=tracer))
    llm.engine.run_until_finished([rid])
    return tracer.first_logits


def reference(hf, layer: int, kind: str, head: int) -> torch.Tensor:
    """transformers' last-position logits with the component zeroed by hooks: a head's (or every
    head's) slice of the output projection's input, or the MLP's output."""
    block = hf.model.layers[layer]
    d = hf.config.head_dim if getattr(hf.config, "head_dim", None) else hf.config.hidden_size // hf.config.num_attention_heads
    if kind == "mlp":
        handle = block.mlp.register_forward_hook(lambda mod, args, out: torch.zeros_like(out))
    else:
        def zero_heads(mod, args):
            x = args[0].clone()
            if kind == "head":
                x[..., head * d : (head + 1) * d] = 0
            else:
                x.zero_()
            return (x,)
        handle = block.self_attn.o_proj.register_forward_pre_hook(zero_heads)
    try:
        with torch.no_grad():
            return hf(torch.tensor([PROMPT])).logits[0, -1].float()
    finally:
        handle.remove()


@pytest.mark.parametrize("layer,kind,head", [(0, "head", 1), (1, "attention", 0), (1, "mlp", 0)])
def test_an_ablated_pass_equals_transformers_with_hooks(tiny, layer, kind, head):
    hf, llm = tiny
    plain, ablated = ours(llm, None), ours(llm, Ablation(layer, kind, head))
    with torch.no_grad():
        ref_plain = hf(torch.tensor([PROMPT])).logits[0, -1].float()
    ref = reference(hf, layer, kind, head)
    assert torch.allclose(plain, ref_plain, atol=1e-4, rtol=1e-4)
    assert torch.allclose(ablated, ref, atol=1e-4, rtol=1e-4)
    assert (ablated - plain).abs().max() > 1e-3  # the ablation changed something


PROMPT_B = [5, 17, 201, 34, 41, 270, 91, 12, 8]


def ours_patched(llm, patch) -> tuple[torch.Tensor, TraceRecorder]:
    tracer = TraceRecorder(llm.engine.config, last_row_only=True)
    tracer.patch = patch
    ids = PROMPT if patch is not None else PROMPT_B
    rid = llm.engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1), options=RequestOptions(tracer=tracer))
    llm.engine.run_until_finished([rid])
    return tracer.first_logits, tracer


@pytest.mark.parametrize("layer", [0, 1])
def test_a_patched_pass_equals_transformers_with_hooks(tiny, layer):
    """Activation patching: prompt A's pass with the last position's residual after `layer`
    replaced by prompt B's gives the logits `transformers` gives with the same replacement made by
    a forward hook on that decoder layer."""
    hf, llm = tiny
    _, rec_b = ours_patched(llm, None)
    last = len(PROMPT) - 1
    logits, _ = ours_patched(llm, (layer, last, rec_b.residual[layer + 1, last]))
    seen = {}
    def keep(mod, args, out):  # (returns None: the output stays)
        seen["b"] = (out[0] if isinstance(out, tuple) else out)[0, last].clone()

    grab = hf.model.layers[layer].register_forward_hook(keep)
    with torch.no_grad():
        hf(torch.tensor([PROMPT_B]))
    grab.remove()

    def put(mod, args, out):
        h = out[0] if isinstance(out, tuple) else out
        h = h.clone()
        h[0, last] = seen["b"]
        return (h, *out[1:]) if isinstance(out, tuple) else h

    handle = hf.model.layers[layer].register_forward_hook(put)
    try:
        with torch.no_grad():
            ref = hf(torch.tensor([PROMPT])).logits[0, -1].float()
    finally:
        handle.remove()
    assert torch.allclose(rec_b.residual[layer + 1, last], seen["b"], atol=1e-4, rtol=1e-4)
    assert torch.allclose(logits, ref, atol=1e-4, rtol=1e-4)
