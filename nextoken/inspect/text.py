"""Tokenizer and embedding widgets: tokens as typed, the BPE merge replay, the embedding map
(PCA) and the word analogy, all on the model's own tokenizer and embedding table."""

from __future__ import annotations

import functools
import json

import torch

from nextoken.errors import InvalidRequest

MAX_TEXT_CHARS = 8000
MAX_WORD_CHARS = 64
MAX_WORDS = 40
SPACE_MARK = "\u2423"  # ␣, the seed's leading-space marker


@functools.lru_cache(maxsize=4)
def _tokenizer_json(tok) -> dict:
    return json.loads(tok.hf_tokenizer.to_str())


def display(text: str) -> str:
    """A token's text with its leading space shown as ␣ and newlines and tabs as ↵ and ⇥."""
    if text.startswith(" "):
        text = SPACE_MARK + text[1:]
    return text.replace("\n", "\u21b5").replace("\t", "\u21e5")


def tokens_view(tok, text: str, chat: bool = False) -> dict:
    """Tokens of `text` (or of `text` as a user message through the chat template): for each
    its id, vocabulary piece, bytes, shown text, and whether it is special or a partial UTF-8
    sequence (a byte-fallback token). Raises `InvalidRequest` for empty or over-long text."""
    if not isinstance(text, str) or not text:
        raise InvalidRequest("text is empty", "text")
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidRequest(f"text has {len(text)} characters; at most {MAX_TEXT_CHARS}", "text")
    rendered = None
    if chat:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.encode(rendered if chat else text)
    out = []
    for i in ids:
        raw = tok.token_bytes(i)
        try:
            shown, partial = raw.decode("utf-8"), False
        except UnicodeDecodeError:
            lead = raw[:1] == b" "
            shown, partial = (" " if lead else "") + "".join(f"<0x{b:02X}>" for b in raw[lead:]), True
        out.append({"id": i, "piece": tok.tokens[i], "text": shown, "display": display(shown),
                    "special": i in tok.special_ids, "partial_utf8": partial, "bytes": raw.hex()})
    return {"tokens": out, "count": len(ids), "rendered": rendered, "vocab_size": tok.vocab_size,
            "chars": len(text)}


@functools.lru_cache(maxsize=4)
def _merge_ranks(tok) -> tuple[dict[tuple[str, str], int], dict[str, int], bool]:
    model = _tokenizer_json(tok)["model"]
    if model.get("type") != "BPE":
        raise InvalidRequest(f"the tokenizer is {model.get('type')}, not BPE: no merges to replay", "word")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
    return {m: r for r, m in enumerate(merges)}, model["vocab"], bool(model.get("ignore_merges"))


def bpe_replay(tok, word: str) -> dict:
    """Replay byte-pair encoding (Sennrich et al. 2016) on `word` with the model's own merge
    list: the pre-tokenizer's pieces, then for each piece the symbols after every merge (the
    adjacent pair of lowest rank is merged, as the tokenizer does), and the ids it ends with.
    Raises `InvalidRequest` for an empty or over-long word."""
    if not isinstance(word, str) or not word:
        raise InvalidRequest("word is empty", "word")
    if len(word) > MAX_WORD_CHARS:
        raise InvalidRequest(f"word has {len(word)} characters; at most {MAX_WORD_CHARS}", "word")
    ranks, vocab, ignore_merges = _merge_ranks(tok)
    hf = tok.hf_tokenizer
    text = hf.normalizer.normalize_str(word) if hf.normalizer is not None else word
    pieces = [p for p, _ in hf.pre_tokenizer.pre_tokenize_str(text)] if hf.pre_tokenizer is not None else [text]
    out = []
    for piece in pieces:
        if ignore_merges and piece in vocab:  # Llama 3: a whole word in the vocabulary is taken as is
            out.append({"piece": piece, "start": [piece], "steps": [], "ids": [vocab[piece]]})
            continue
        symbols = list(piece)
        start = list(symbols)
        steps = []
        while len(symbols) > 1:
            pairs = [(ranks.get((a, b)), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
            pairs = [(r, i) for r, i in pairs if r is not None]
            if not pairs:
                break
            rank, i = min(pairs)
            pair = (symbols[i], symbols[i + 1])
            symbols = symbols[:i] + [pair[0] + pair[1]] + symbols[i + 2:]
            steps.append({"pair": list(pair), "rank": rank, "symbols": list(symbols)})
        ids = [vocab.get(s) for s in symbols]
        out.append({"piece": piece, "start": start, "steps": steps, "ids": ids})
    return {"word": word, "pieces": out, "ids": [i for p in out for i in p["ids"]],
            "tokenizer_ids": tok.encode(word, add_bos=False), "num_merges": len(ranks)}


def word_token(tok, word: str, field: str = "words") -> int:
    """The one token id of `word`: with a leading space (as inside a sentence) if that is one
    token, else as written (stripped; a word of only whitespace as it is). Raises
    `InvalidRequest` when it is neither."""
    if not isinstance(word, str) or not word or len(word) > MAX_WORD_CHARS:
        raise InvalidRequest(f"{word!r} is not a word (1..{MAX_WORD_CHARS} characters)", field)
    for form in (" " + word.strip(), word.strip()) if word.strip() else (word,):
        ids = tok.encode(form, add_bos=False)
        if len(ids) == 1:
            return ids[0]
    raise InvalidRequest(f"{word!r} is not a single token of this model's vocabulary (it splits into "
                         f"{len(tok.encode(' ' + word.strip(), add_bos=False))} tokens); pick another word", field)


def embedding_rows(model, ids: list[int]) -> torch.Tensor:
    """Rows of the embedding table as stored, de-quantized in float32 (not rounded to the
    model's compute dtype), ``[len(ids), hidden]``, on the CPU."""
    emb = model.embed_tokens
    idx = torch.tensor(ids, dtype=torch.long, device="cpu")
    with torch.inference_mode():
        if emb.qweight is not None:
            return emb.qweight.lookup(idx).float()
        if emb.q8 is not None:
            q, d = emb.q8
            return (q[idx].view(len(ids), -1, 32).float() * d[idx].float()[..., None]).view(len(ids), -1)
        return emb.weight[idx.to(emb.weight.device)].float().cpu()


def embedding_map(model, tok, words: list[str]) -> dict:
    """2D principal components of the embedding rows of `words` (each one token): coordinates,
    the share of variance the two components explain, and each row's norm."""
    if not isinstance(words, list) or not 3 <= len(words) <= MAX_WORDS:
        raise InvalidRequest(f"words must list 3..{MAX_WORDS} words", "words")
    ids = [word_token(tok, w) for w in words]
    x = embedding_rows(model, ids)
    xc = x - x.mean(0)
    _, s, vh = torch.linalg.svd(xc, full_matrices=False)
    xy = xc @ vh[:2].T
    var = s ** 2
    return {"points": [{"word": w, "id": i, "token": display(tok.token_text(i)), "x": round(float(p[0]), 5),
                        "y": round(float(p[1]), 5), "norm": round(float(r.norm()), 4)}
                       for w, i, p, r in zip(words, ids, xy, x)],
            "explained_variance": [round(float(v), 4) for v in (var[:2] / var.sum().clamp_min(1e-30))],
            "hidden_size": x.shape[1]}


def analogy(model, tok, a: str, b: str, c: str, target: str, top: int = 10, chunk: int = 8192) -> dict:
    """``E[a] - E[b] + E[c]`` on the real embedding table (Mikolov et al. 2013): the nearest
    tokens by cosine similarity (the three inputs left out, as word2vec does), and the rank and
    cosine of `target`. The table is read `chunk` rows at a time."""
    ia, ib, ic = (word_token(tok, w, f) for w, f in ((a, "a"), (b, "b"), (c, "c")))
    it = word_token(tok, target, "target")
    rows = embedding_rows(model, [ia, ib, ic])
    v = rows[0] - rows[1] + rows[2]
    vocab = model.config.vocab_size
    cos = torch.empty(vocab)
    for s in range(0, vocab, chunk):
        e = embedding_rows(model, list(range(s, min(s + chunk, vocab))))
        cos[s : s + e.shape[0]] = torch.nn.functional.cosine_similarity(e, v[None, :], dim=-1)
    ranked = cos.clone()
    ranked[[ia, ib, ic]] = float("-inf")
    vals, idx = ranked.topk(top)
    rank = int((ranked > ranked[it]).sum()) + 1
    return {"ids": {"a": ia, "b": ib, "c": ic, "target": it},
            "vector": [round(float(t), 6) for t in v], "nearest": [
                {"id": int(i), "token": display(tok.token_text(int(i))), "cosine": round(float(s), 4)}
                for s, i in zip(vals, idx)],
            "target": {"token": display(tok.token_text(it)), "rank": rank, "cosine": round(float(cos[it]), 4)},
            "inputs_cosine": {w: round(float(cos[i]), 4) for w, i in (("a", ia), ("b", ib), ("c", ic))},
            "vocab_size": vocab}
