"""``nextoken perplexity`` and ``watermark detect``: scoring text."""

from __future__ import annotations

import dataclasses
import json

from nextoken.cli.common import _read_text, engine_args


def cmd_perplexity(a) -> int:
    """`nextoken perplexity FILE|-`: llama-perplexity's method (`nextoken.evaluate.perplexity`)."""
    from nextoken.engine.engine import LLMEngine
    from nextoken.evaluate.perplexity import perplexity, reference_args

    text = _read_text(a.file)
    args = engine_args(a)
    engine = LLMEngine.from_engine_args(args)
    reference = None
    if a.kl_divergence:
        reference = LLMEngine.from_engine_args(reference_args(args))
    res = perplexity(engine, text, a.ctx, reference, a.max_chunks, progress=not a.json)
    if a.json:
        out = dataclasses.asdict(res)
        out.pop("nll")
        print(json.dumps(out))
        return 0
    print(f"{res.num_chunks} chunks of {a.ctx} tokens, {res.num_tokens_scored} tokens scored")
    print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_uncertainty:.5f}")
    if res.kl_mean is not None:
        print(f"Mean KLD vs the float32 reference: {res.kl_mean:.6f} +/- {res.kl_uncertainty:.6f}; "
              f"same top token: {100 * res.top1_agreement:.2f}%")
    return 0


def cmd_watermark(a) -> int:
    """`nextoken watermark detect FILE|-`: needs the model's tokenizer and vocabulary size only."""
    from nextoken.catalog import resolve_model
    from nextoken.errors import InvalidRequest
    from nextoken.loader.source import load_tokenizer, open_model
    from nextoken.runner.model_runner import read_config
    from nextoken.sample.watermark import WatermarkConfig, detect

    try:
        WatermarkConfig(gamma=a.watermark_gamma)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "watermark_gamma") from None
    text = _read_text(a.file)
    source = open_model(resolve_model(a.model))
    ids = load_tokenizer(source).encode(text, add_bos=False, parse_special=False)
    res = detect(ids, read_config(source).vocab_size, a.watermark_gamma, a.z_threshold)
    if a.json:
        print(json.dumps(dataclasses.asdict(res)))
    else:
        print(f"tokens scored {res.num_tokens_scored}, green {res.num_green_tokens} "
              f"({res.green_fraction:.1%}, expected {a.watermark_gamma:.0%}), z = {res.z_score:.2f}: "
              f"{'watermarked' if res.watermarked else 'no watermark found'} (threshold z > {a.z_threshold})")
    return 0
