"""The sampler: logits of a batch of requests -> one token id each, batched.

Per step, for the batch as a whole (in the manner of vLLM v1's ``Sampler`` and
``SamplingMetadata``):

1. log-probabilities of the raw logits, before anything below (as vLLM does): one
   ``log_softmax`` over the rows that ask, one ``topk`` with the largest n asked;
2. the processors (`logits_processors.process_rows`: min_tokens block, logit bias, penalties,
   watermark) on a copy of the rows that have any, each edit one sparse operation;
3. structured output: a row under a grammar first draws from its unmasked logits and keeps the
   token if the grammar allows it (exact, see `draw_unmasked_is_exact`), else it is masked
   and drawn again;
4. the draw (`draw_rows`): greedy argmax, or temperature -> top-k -> top-p -> min-p -> one
   uniform number u from the request's own ``torch.Generator`` and the inverse CDF of the kept
   tokens in id order. The rule is written once in PyTorch (`torch_draw`, the plain path, with
   sorts over the whole vocabulary) and run by our C kernel (``kernels/sampling.c``: no sort of
   the vocabulary, rows in parallel) when the engine runs its kernels, or on a GPU by our Triton
   kernel (`kernels.gpu.sampling`: one program a row, bisections on the floats' order keys
   instead of sorts). Each row consumes exactly one u per draw whatever else is in the batch, so
   a seeded request gives the same tokens alone and in any batch.

The settings of the batch's rows (temperature, top-k, top-p, min-p, which rows need processing
or log-probabilities) are tensors built once and reused while the batch is the same
(`SamplingMetadata`), on the logits' device: on a GPU the whole chain runs there, and what the
host decides (which rows are greedy, whether any filter is on) it knows from the rows'
settings, so a step's only copy back is the chosen ids (and log-probabilities when asked). Speculative verification, the draft model, the inspector and `nextoken
explain` get whole distributions from `distributions` (the same processors and rule).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np
import torch

from nextoken.kernels import count_fallback
from nextoken.sample.draw import row_settings, sample_rows
from nextoken.sample.rng import DrawGenerator
from nextoken.sample.logits_processors import RowEdits, TokenHistory, has_processors, needs_edits, process_rows
from nextoken.sample.watermark import WatermarkConfig
from nextoken.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplerRequest:
    """One row of the batch: its params, its history (for penalties), its random stream and,
    under structured output, its grammar state (`structured.backend.SequenceGrammar`)."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: DrawGenerator | None  # None: the process's shared stream
    grammar: object | None = None
    history: TokenHistory | None = field(default=None, repr=False)  # penalties' counts, made on first use


@dataclass(slots=True)
class SampleResult:
    """The token drawn for one row and, when asked, its log-probabilities.

    logprob: log-probability of `token` under the raw distribution (or None);
    top_logprobs: the N most likely ``(token, logprob)`` pairs, best first;
    kept: bool ``[vocab]`` mask of the candidates the settings allowed (only with keep_details);
    probs: float32 ``[vocab]`` distribution the token was drawn from (only with keep_details);
    error: what failed for this row alone (its token is then -1).
    """

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    kept: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    error: str | None = None  # this row's processors or grammar raised: no token (-1), the others go on


@dataclass(slots=True)
class SampleLaunch:
    """A batch's draw in flight (`Sampler.launch`): the chosen ids and the asked log-probabilities
    as tensors on the logits' device, their copies to the host started (non-blocking on a GPU,
    an event marking their end), so the host can go on (launch the next step, which may take
    `tokens` as its input on the device) before it reads them with `results`.

    tokens: int64 ``[b]``; finite: bool ``[b]`` (each row free of NaN and infinity), or a list
    (the C kernel's), ``[]`` when not asked; chosen: float32 ``[len(meta.logprob_rows)]``,
    top_vals / top_ids ``[len(meta.logprob_rows), n]`` (None when no row asks)."""

    FIELDS = ("tokens", "finite", "chosen", "top_vals", "top_ids")

    meta: "SamplingMetadata"
    tokens: torch.Tensor
    finite: torch.Tensor | list[bool]
    chosen: torch.Tensor | None = None
    top_vals: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    host: dict | None = None  # the fields' host copies (a GPU's), once started
    event: object | None = None  # a CUDA event recorded after those copies

    def to_host(self) -> SampleLaunch:
        """Start the copies to the host (into pinned memory, non-blocking) and record their
        event; nothing to do for CPU tensors."""
        if self.tokens.device.type == "cpu":
            return self
        self.host = {name: getattr(self, name).to("cpu", non_blocking=True) for name in self.FIELDS
                     if isinstance(getattr(self, name), torch.Tensor)}
        self.event = torch.cuda.Event()
        self.event.record()
        return self

    def wait(self) -> None:
        """Wait until the copies to the host are done (the device has drawn): the event, not the
        stream, so the steps launched after it run on."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def results(self) -> tuple[list[SampleResult], list[bool]]:
        """Wait for the copies; each row's `SampleResult` and whether its logits were finite."""
        self.wait()
        host = self.host or {}
        get = lambda name: host.get(name, getattr(self, name))  # noqa: E731
        results = [SampleResult(t) for t in get("tokens").tolist()]
        m = self.meta
        if m.logprob_rows:
            chosen = get("chosen").tolist()
            top_vals = top_ids = None
            if m.max_logprobs:
                top_vals, top_ids = get("top_vals").tolist(), get("top_ids").tolist()
            for j, i in enumerate(m.logprob_rows):
                res = results[i]
                res.logprob = chosen[j]
                n = m.num_logprobs[j]
                res.top_logprobs = list(zip(top_ids[j][:n], top_vals[j][:n])) if n else []
        finite = get("finite")
        return results, finite if isinstance(finite, list) else finite.tolist()


def plain_row(row: SamplerRequest) -> bool:
    """Whether `row`'s token follows from its logits with nothing from the host between (no
    grammar, no processor): what `Sampler.launch` takes."""
    return row.grammar is None and not has_processors(row.params)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor of `dtype` on `device`. On a GPU the copy goes from pinned memory
    without waiting: ``torch.tensor(values, device="cuda")`` copies from pageable memory, and
    PyTorch's blocking copy synchronizes the whole stream, which would hold the host until the
    pass in flight ends (async scheduling launches the next step's sampler while it runs)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, device="cpu").pin_memory().to(device, non_blocking=True)


def make_generator(seed: int | None) -> DrawGenerator:
    """A request's stream of draws (`sample.rng.DrawGenerator`) seeded with `seed` (a fresh
    random seed when None)."""
    return DrawGenerator(seed)


_shared = DrawGenerator()


def uniform(generator: DrawGenerator | None) -> float:
    """One uniform number in [0, 1) from `generator` (None: the process's shared stream): what
    one draw consumes."""
    return (generator or _shared).uniform()


# -- the rule, in PyTorch (the plain path) --------------------------------------------------
def filter_masks(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 active: bool | None = None) -> torch.Tensor:
    """Which tokens survive top-k, then top-p, then min-p, on rows of temperature-scaled logits
    x ``[b, vocab]`` float32 with per-row settings ``[b]`` (top_k <= 0: off; top_p 1: off; min_p
    0: off). Returns bool ``[b, vocab]``. The rule (``kernels/sampling.c`` runs the same): order
    by x descending, ties by id; e = exp(x - max); top-k keeps the first k; top-p keeps a token
    while the mass before it (exclusive sum of e in that order, float64) is below top_p times the
    top-k mass (Holtzman et al. 2019); min-p keeps e >= min_p, i.e. p >= min_p * p_max (Nguyen
    et al. 2024). The most likely token always survives; rows with every filter off keep all.
    `active`: whether any row has a filter on, when the caller knows (else read from the
    settings, a copy to the host on a GPU)."""
    b, V = x.shape
    if active is None:
        active = bool((((top_k > 0) & (top_k < V)) | (top_p < 1.0) | (min_p > 0)).any())
    if not active:
        return torch.ones(b, V, dtype=torch.bool, device=x.device)  # no filter on any row: nothing to sort
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    e = (sorted_x - sorted_x[:, :1]).exp()
    k = torch.where((top_k > 0) & (top_k < V), top_k.long(), torch.full_like(top_k, V, dtype=torch.long))
    keep = torch.arange(V, device=x.device)[None, :] < k[:, None]
    ed = torch.where(keep, e.double(), 0.0)
    before = torch.cat([ed.new_zeros(b, 1), ed.cumsum(-1)[:, :-1]], dim=1)
    zk = ed.sum(-1, keepdim=True)
    keep &= (before < top_p.double()[:, None] * zk) | (top_p >= 1.0)[:, None]
    keep &= e >= min_p[:, None]
    keep[:, 0] = True
    out = torch.empty_like(keep)
    out.scatter_(1, order, keep)
    return out


def filter_mask(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """`filter_masks` for one row ``[vocab]`` and scalar settings; returns bool ``[vocab]``."""
    dev = logits.device
    return filter_masks(logits[None].float(), torch.tensor([top_k], device=dev),
                        torch.tensor([top_p], dtype=torch.float32, device=dev),
                        torch.tensor([min_p], dtype=torch.float32, device=dev))[0]


def draw(weights: torch.Tensor, u: torch.Tensor | float) -> torch.Tensor:
    """The inverse-CDF draw: for each row of non-negative weights ``[..., vocab]`` (in id order),
    the first token whose running sum (float64) exceeds u times the total. ``u`` in [0, 1)
    (a float or ``[...]``); returns int64 ``[...]``."""
    s = weights.double().cumsum(-1)
    u = torch.as_tensor(u, dtype=torch.float64, device=weights.device)
    target = (u * s[..., -1]).unsqueeze(-1)
    return torch.searchsorted(s, target, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)


def kept_weights(rows: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, active: bool | None = None,
                 kept: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For sampled rows ``[b, vocab]`` (temperature > 0): (kept bool ``[b, vocab]``, the draw's
    weights e = exp(x - max) on the kept tokens, 0 elsewhere, float32 ``[b, vocab]``). `active`:
    as `filter_masks`'s; `kept`: the kept tokens when the caller has them (the C kernel's
    `kept_masks`), else `filter_masks`'."""
    x = rows / temperature[:, None]
    if kept is None:
        kept = filter_masks(x, top_k, top_p, min_p, active)
    e = (x - x.max(-1, keepdim=True).values).exp()
    return kept, torch.where(kept, e, 0.0)


def torch_draw(rows: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, u: torch.Tensor, sampled: list[int] | None = None,
               active: bool | None = None) -> torch.Tensor:
    """The draw of every row ``[b, vocab]`` float32 (the plain path of `draw_rows`): greedy rows
    (temperature 0) their first argmax, the others `draw` over `kept_weights`. Returns int64
    ``[b]``, on the rows' device. `sampled` (the rows with temperature > 0) and `active` (any
    filter on among them), when the caller knows them, spare copies to the host."""
    tokens = rows.argmax(-1)
    if sampled is None:
        sampled = (temperature > 0).nonzero().flatten().tolist()
    if sampled:
        s = to_device(sampled, torch.long, rows.device) if len(sampled) < rows.shape[0] else slice(None)
        _, w = kept_weights(rows[s], temperature[s], top_k[s], top_p[s], min_p[s], active)
        tokens[s] = draw(w, u[s])
    return tokens


class _Kernel:
    """``kernels/sampling.c``'s ``sample_rows`` (and ``rows_finite``) over row addresses. The
    per-step arguments go as ``array`` buffers, not tensors: run right after a decode step has
    streamed the weights through the caches, each distinct PyTorch operation took 15-40 us cold
    (a one-element ``torch.tensor`` 28-38 us against 2-3 warm), which made the draw of one
    SmolLM2 row 0.19 ms, four times its two passes over the logits."""

    def __init__(self, lib):
        self.lib = lib

    def finite(self, logits: torch.Tensor) -> list[bool]:
        """`finite_rows` of float32 CPU logits ``[b, vocab]`` with unit stride along the vocabulary."""
        b, V = logits.shape
        base, stride = logits.data_ptr(), logits.stride(0) * logits.element_size()
        rows, out = array("q", [base + i * stride for i in range(b)]), array("B", bytes(b))
        self.lib.rows_finite(rows.buffer_info()[0], b, V, out.buffer_info()[0])
        return [x != 0 for x in out]

    def __call__(self, addresses: list[int], V: int, settings: tuple[int, int, int, int], u: list[float],
                 check_finite: bool = False) -> tuple[torch.Tensor, list[bool] | None]:
        """Tokens int64 ``[len(addresses)]`` of the float32 rows at `addresses`, and with
        `check_finite` each row's finiteness (`finite`'s, found in the draw's first pass over the
        row; else None); `settings`: the addresses of the rows' temperature, top-k, top-p and
        min-p (`SamplingMetadata`'s tensors, or slices of them), `u` each row's uniform number."""
        b = len(addresses)
        rows, us = array("q", addresses), array("f", u)
        tokens = torch.empty(b, dtype=torch.int64, device="cpu")
        flags = array("B", bytes(b)) if check_finite else None
        sample_rows(self.lib, rows.buffer_info()[0], b, V, *settings, us.buffer_info()[0], tokens.data_ptr(),
                    flags.buffer_info()[0] if flags is not None else None)
        return tokens, [x != 0 for x in flags] if flags is not None else None

    def kept_masks(self, rows: torch.Tensor, settings: tuple[int, int, int, int]) -> torch.Tensor:
        """Which tokens each row's filters keep, as the draw keeps them: bool ``[b, vocab]`` for
        float32 CPU rows ``[b, vocab]`` (contiguous) and their settings' addresses (as `__call__`'s);
        a row without a filter keeps every token, as `filter_masks`'. Tokens of weight 0 (e
        below e^-87, -inf) are never kept, where `filter_masks` keeps those within a top-k;
        their probability is 0 either way. Raises `MemoryError` when the kernel cannot allocate
        its scratch memory."""
        b, V = rows.shape
        masks = torch.ones(b, V, dtype=torch.uint8)
        addresses = array("q", [rows.data_ptr() + i * V * 4 for i in range(b)])
        if self.lib.kept_masks(addresses.buffer_info()[0], b, V, *settings, masks.data_ptr()):
            raise MemoryError("the sampling kernel could not allocate its scratch memory")
        return masks.view(torch.bool)


# -- the batch's settings -------------------------------------------------------------------
@dataclass
class SamplingMetadata:
    """The settings of a batch's rows as tensors ``[B]``, built once per batch (`Sampler` keeps
    the last one and reuses it while the same rows come back)."""

    temperature: torch.Tensor  # float32, 0 for greedy rows
    top_k: torch.Tensor  # int32, 0 = off
    top_p: torch.Tensor  # float32, 1 = off
    min_p: torch.Tensor  # float32, 0 = off
    processed: list[int]  # rows with any processor (min_tokens: edits only until it is reached)
    logprob_rows: list[int]  # rows that ask for log-probabilities
    num_logprobs: list[int]  # how many top log-probabilities each of those asks
    max_logprobs: int
    rows: list = field(default_factory=list, repr=False)  # the rows it was built for (held: see `Sampler.metadata`)
    filtered: list[bool] = field(default_factory=list)  # per row: a sampled row with top-k, top-p or min-p on
    plain: bool = True  # every row `plain_row`: no grammar, no processor
    _addresses: tuple[int, int, int, int] | None = field(default=None, repr=False)

    def addresses(self) -> tuple[int, int, int, int]:
        """The addresses of temperature, top_k, top_p and min_p (CPU tensors) for the draw's C
        kernel, taken once per batch (`_Kernel`: each call into PyTorch runs cold there)."""
        if self._addresses is None:
            self._addresses = tuple(t.data_ptr() for t in (self.temperature, self.top_k, self.top_p, self.min_p))
        return self._addresses

    @classmethod
    def build(cls, rows: list[SamplerRequest], V: int, device: torch.device | None = None) -> SamplingMetadata:
        """The settings of `rows` for a vocabulary of `V`, as tensors on `device` (the logits')."""
        device = device or torch.device("cpu")
        ps = [r.params for r in rows]
        settings = list(zip(*(row_settings(p, V) for p in ps))) or [(), (), (), ()]
        temperature = to_device(list(settings[0]), torch.float32, device)
        top_k = to_device(list(settings[1]), torch.int32, device)
        top_p = to_device(list(settings[2]), torch.float32, device)
        min_p = to_device(list(settings[3]), torch.float32, device)
        lp = [i for i, p in enumerate(ps) if p.logprobs is not None]
        processed = [i for i, p in enumerate(ps) if has_processors(p)]
        filtered = [t > 0 and (k > 0 or tp < 1.0 or mp > 0) for t, k, tp, mp in zip(*settings)]
        return cls(temperature, top_k, top_p, min_p, processed, lp, [ps[i].logprobs for i in lp],
                   max((ps[i].logprobs for i in lp), default=0), list(rows), filtered, all(map(plain_row, rows)))


def draw_unmasked_is_exact(row: SamplerRequest, history: list[int]) -> bool:
    """The fast path of structured output (as llama.cpp samples under a grammar): draw from the
    unmasked distribution and keep the token if the grammar allows it, else mask and draw again.
    Exact where masking commutes with the row's sampling (greedy, or no top-k, top-p or min-p,
    which pick their candidates from the unmasked logits otherwise): greedy, the unmasked argmax,
    when allowed, is the masked argmax; sampled, an allowed token x comes out with probability
    p(x) + (1 - A) p(x) / A = p(x) / A, A the allowed mass, which is the masked distribution. It
    saves the mask (tens of microseconds) on most tokens. Not while min_tokens blocks the end or
    the grammar forces bytes (then the mask is small and decides)."""
    p = row.params
    commutes = p.greedy or (p.top_k <= 0 and p.top_p >= 1.0 and p.min_p == 0.0)
    return commutes and len(history) >= p.min_tokens and not row.grammar.forced()


def _mask(logits: torch.Tensor, refused: torch.Tensor, raw: torch.Tensor, blocked_eog: bool) -> torch.Tensor:
    """`logits` with the `refused` tokens at -inf. When min_tokens blocked every token the
    grammar allows (it allows only the end), the grammar wins: `raw` masked instead."""
    out = logits.masked_fill(refused, float("-inf"))
    if blocked_eog and not torch.isfinite(out).any():
        out = raw.masked_fill(refused, float("-inf"))
    return out


def _fail(result: SampleResult, exc: Exception) -> None:
    """A row whose processors or grammar raised: no token, the error kept for its request."""
    result.token, result.error = -1, f"{type(exc).__name__}: {exc}"


class Sampler:
    """Samples one token per row; see the module docstring for the order of operations.
    `kernel`: the ``sampling`` library the execution plan resolved (`kernels.KernelSet`), the
    draw's C kernel; None (``enforce_eager``, no compiler): the plain PyTorch path.
    `triton_min_rows`: draws of at least this many rows (0: none) with a sampled row run on
    `kernels.gpu.sampling` (a GPU plan's; on the CPU only under Triton's interpreter), the same
    rule without sorting the vocabulary (fewer rows leave most of a GPU idle: PyTorch's draw)."""

    def __init__(self, eog_ids: frozenset[int] = frozenset(), watermark: WatermarkConfig | None = None,
                 kernel=None, triton_min_rows: int = 0):
        self.eog_ids = eog_ids
        self.watermark = watermark
        self.kernel = _Kernel(kernel) if kernel is not None else None
        self.triton_draw = None
        if triton_min_rows:
            from nextoken.kernels.gpu.sampling import draw_rows

            self.triton_draw = draw_rows
        self.triton_min_rows = triton_min_rows
        self._meta: SamplingMetadata | None = None

    @classmethod
    def for_plan(cls, eog_ids: frozenset[int], watermark: WatermarkConfig | None, plan) -> Sampler:
        """The sampler a `runner.plan.ExecutionPlan` chose (its C or Triton draw, or PyTorch's)."""
        return cls(eog_ids, watermark, plan.kernels.sampling, plan.sampling_rows if plan.triton_sampling else 0)

    def finite_rows(self, logits: torch.Tensor) -> list[bool]:
        """Whether each row of logits ``[b, vocab]`` is free of NaN and infinity (`finite_flags`)."""
        flags = self.finite_flags(logits)
        return flags if isinstance(flags, list) else flags.tolist()

    def finite_flags(self, logits: torch.Tensor) -> torch.Tensor | list[bool]:
        """`finite_rows` as a list from ``sampling.c``'s ``rows_finite`` on float32 CPU rows when
        the kernel is there, else PyTorch's isfinite as a bool tensor ``[b]`` on the logits' device
        (the plain path; a sum per row would also flag huge finite rows whose sum overflows)."""
        if self.kernel is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 \
                and logits.dim() == 2 and logits.stride(1) == 1:
            return self.kernel.finite(logits)
        return torch.isfinite(logits).all(dim=-1)

    def launch(self, logits: torch.Tensor, rows: list[SamplerRequest], check_finite: bool = True) -> SampleLaunch:
        """The draw of `rows` (each `plain_row`) from logits ``[b, vocab]``, left in flight: the tokens,
        the asked log-probabilities and (with `check_finite`) each row's finiteness as tensors on
        the logits' device, their copies to the host started (`SampleLaunch.to_host`). No copy
        back waits here, so a GPU's next step can be launched before `SampleLaunch.results`.
        The same draw as `__call__` (which runs it for such rows), one uniform number per
        sampled row."""
        B, V = logits.shape
        meta = self.metadata(rows, V, logits.device)
        tokens, finite = self._draw(logits, rows, list(range(B)), {}, meta, check_finite)
        if finite is None:  # (not found by the draw's own call)
            finite = self.finite_flags(logits) if check_finite else []
        if check_finite and not (isinstance(finite, list) and all(finite)):
            tokens = tokens.clamp_(0, V - 1)  # (a row of NaN may draw anything: keep it a token id, for the next step's input)
        out = SampleLaunch(meta, tokens, finite)
        return self._logprob_tensors(logits, out).to_host()

    def draw_checked(self, logits: torch.Tensor, rows: list[SamplerRequest]
                     ) -> tuple[list[SampleResult], list[bool]] | None:
        """`__call__`'s results for rows that are all on the plain path (no processors, grammars
        or details), with each row's finiteness (`finite_rows`) read back in the same copies: one
        wait for the device instead of two. None for other rows (the caller checks and draws apart)."""
        if not self.metadata(rows, logits.shape[1], logits.device).plain:
            return None
        return self.launch(logits, rows).results()

    # -- the step ---------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, rows: list[SamplerRequest],
                 keep_details: bool = False) -> list[SampleResult]:
        """logits: float32 ``[batch, vocab]`` (never changed); rows: one `SamplerRequest` per
        logits row. `keep_details` (the tracers' one-row passes): each result also carries the
        kept mask and the distribution drawn from. A row whose processors or grammar raise gets
        no token (-1) and `SampleResult.error`; the other rows are drawn as without it."""
        B, V = logits.shape
        meta = self.metadata(rows, V, logits.device)
        if not keep_details and meta.plain:
            return self.launch(logits, rows, check_finite=False).results()[0]
        results = [SampleResult(-1) for _ in rows]
        edited = [i for i in meta.processed if needs_edits(rows[i].params, len(rows[i].output_ids))]
        source = self._process_isolated(logits, rows, edited, results)
        retry = []
        for i, r in enumerate(rows):  # grammars: masked now, unless the unmasked draw is exact (then after, if refused)
            if r.grammar is None or results[i].error:
                continue
            if keep_details or not draw_unmasked_is_exact(r, r.output_ids):
                try:
                    source[i] = self._masked(logits[i], source.get(i), r, r.output_ids)
                except Exception as exc:  # noqa: BLE001 - one row's fault ends only its own request
                    _fail(results[i], exc)
            else:
                retry.append(i)
        ok = [i for i in range(B) if not results[i].error]
        if keep_details:
            self._draw_with_details(logits, rows, source, results)
        elif ok:
            for i, t in zip(ok, self._draw(logits, rows, ok, source, meta)[0].tolist()):
                results[i].token = t
            again = []
            for i in retry:
                try:
                    if not rows[i].grammar.allows(results[i].token):
                        source[i] = self._masked(logits[i], source.get(i), rows[i], rows[i].output_ids)
                        again.append(i)
                except Exception as exc:  # noqa: BLE001
                    _fail(results[i], exc)
            if again:
                for i, t in zip(again, self._draw(logits, rows, again, source, meta)[0].tolist()):
                    results[i].token = t
        self._logprobs(logits, meta, results)
        return results

    def _process_isolated(self, logits, rows, edited: list[int], results: list[SampleResult]) -> dict:
        """Row -> its processed logits for rows `edited`, in one batch; should that raise, row by
        row, and a row that raises alone gets its `SampleResult.error` (its request fails, the
        batch goes on)."""
        histories = [r.output_ids for r in rows]
        try:
            work = self._process(logits, rows, edited, histories)
            return {i: work[j] for j, i in enumerate(edited)}
        except Exception:  # noqa: BLE001 - find the row at fault; the others are processed again alone
            source = {}
            for i in edited:
                try:
                    source[i] = self._process(logits, rows, [i], histories)[0]
                except Exception as exc:  # noqa: BLE001 - one row's fault ends only its own request
                    _fail(results[i], exc)
            return source

    def metadata(self, rows: list[SamplerRequest], V: int, device: torch.device | None = None) -> SamplingMetadata:
        """The batch's settings on `device`: the last batch's when the rows are the same objects
        in the same order (the metadata holds them, so no new row can take a held one's
        identity), else built anew."""
        m = self._meta
        device = device or torch.device("cpu")
        if m is None or len(m.rows) != len(rows) or any(a is not b for a, b in zip(m.rows, rows)) \
                or m.temperature.device != device:
            self._meta = m = SamplingMetadata.build(rows, V, device)
        return m

    def _process(self, logits: torch.Tensor, rows: list[SamplerRequest], which: list[int],
                 histories: list[list[int]]) -> torch.Tensor:
        """The processed logits of rows `which` ``[len(which), vocab]`` (a copy), with each row's
        history (its output ids, then tokens ahead of them)."""
        if not which:
            return logits.new_empty(0, logits.shape[1])
        work = logits[which].float()
        edits = []
        for i in which:
            r = rows[i]
            if r.history is None:
                r.history = TokenHistory(r.prompt_ids)
            edits.append(RowEdits(r.params, r.prompt_ids, r.output_ids, histories[i][len(r.output_ids):], r.history))
        process_rows(work, edits, self.eog_ids, self.watermark)
        return work

    def _masked(self, raw: torch.Tensor, processed: torch.Tensor | None, row: SamplerRequest,
                history: list[int]) -> torch.Tensor:
        refused = row.grammar.refused(history[len(row.output_ids):]).to(raw.device)
        return _mask(raw if processed is None else processed, refused, raw, len(history) < row.params.min_tokens)

    def _draw(self, logits: torch.Tensor, rows: list[SamplerRequest], which: list[int],
              source: dict[int, torch.Tensor], meta: SamplingMetadata,
              check_finite: bool = False) -> tuple[torch.Tensor, list[bool] | None]:
        """Tokens of rows `which` (int64 ``[len(which)]``, on the logits' device): each from its
        processed logits (`source`) or the raw row; one uniform number from each sampled row's
        generator. On a GPU: one copy of the uniform numbers over. With `check_finite`, on the
        CPU's kernel, also each row's finiteness from the same pass; otherwise None."""
        dev = logits.device
        us = [uniform(rows[i].generator) if not rows[i].params.greedy else 0.0 for i in which]
        whole = len(which) == logits.shape[0]  # (every row, in order: `which` is sorted)
        if self.kernel is not None and dev.type == "cpu" and logits.dtype == torch.float32 \
                and logits.stride(1) == 1:  # (no tensor made for a whole batch: see `_Kernel`)
            base, stride = logits.data_ptr(), logits.stride(0) * logits.element_size()
            addresses = [source[i].data_ptr() if i in source else base + i * stride for i in which]
            if whole:
                return self.kernel(addresses, logits.shape[1], meta.addresses(), us, check_finite)
            fields = tuple(t[which] for t in (meta.temperature, meta.top_k, meta.top_p, meta.min_p))
            return self.kernel(addresses, logits.shape[1], tuple(t.data_ptr() for t in fields), us, check_finite)
        u = to_device(us, torch.float32, dev)
        sel = slice(None) if whole else to_device(which, torch.long, dev)
        settings = (meta.temperature[sel], meta.top_k[sel], meta.top_p[sel], meta.min_p[sel], u)
        if whole and not source and logits.dtype == torch.float32:
            stack = logits
        else:
            stack = torch.stack([source[i] if i in source else logits[i].float() for i in which])
        sampled = [j for j, i in enumerate(which) if not rows[i].params.greedy]
        if self.triton_draw is not None and sampled and len(which) >= self.triton_min_rows:  # (all greedy: argmax)
            tokens = self.triton_draw(stack, *settings)
            if tokens is not None:
                return tokens, None
            count_fallback("sampling")
        active = any(meta.filtered[i] for i in which)
        return torch_draw(stack, *settings, sampled=sampled, active=active), None

    def _draw_with_details(self, logits, rows, source, results) -> None:
        """The plain path, keeping each row's kept mask and distribution (`SampleResult.kept`,
        ``.probs``)."""
        for i, (kept, probs) in enumerate(self._final(logits, rows, source)):
            if results[i].error:
                continue
            if probs is None:  # greedy: all the mass on the argmax
                token = kept
                kept = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
                kept[token] = True
                results[i] = SampleResult(token, kept=kept, probs=kept.float())
            else:
                results[i] = SampleResult(int(draw(probs, uniform(rows[i].generator))), kept=kept, probs=probs)

    def _final(self, logits: torch.Tensor, rows: list[SamplerRequest], source: dict[int, torch.Tensor]) -> list[tuple]:
        """Each row's ``(kept, probs)`` (or ``(argmax, None)`` when greedy) from its processed and
        masked logits (`source`, else the raw row); the sampled rows in one `kept_weights` call."""
        out: list[tuple] = [None] * len(rows)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        for i, t in zip(greedy, self._argmax([source.get(i, logits[i]) for i in greedy])):
            out[i] = (t, None)
        if sampled:
            meta = SamplingMetadata.build([rows[i] for i in sampled], logits.shape[1], logits.device)
            stack = torch.stack([source.get(i, logits[i]).float() for i in sampled])
            filtered = any(meta.filtered)
            kept = None  # (PyTorch's rule sorts each row: 12-14 ms for 151936 tokens on one core)
            if self.kernel is not None and stack.device.type == "cpu" and filtered:
                kept = self.kernel.kept_masks(stack, meta.addresses())
            kept, w = kept_weights(stack, meta.temperature, meta.top_k, meta.top_p, meta.min_p, filtered, kept)
            probs = w / w.sum(-1, keepdim=True)
            for j, i in enumerate(sampled):
                out[i] = (kept[j], probs[j])
        return out

    def _argmax(self, rows: list[torch.Tensor]) -> list[int]:
        """The first argmax of each row ``[vocab]``: the draw's C kernel (its greedy rule) for
        float32 CPU rows when it is there (a draft model's proposals: PyTorch's argmax took 0.3 ms
        a row of 151936), else PyTorch's."""
        if self.kernel is not None and rows and all(r.device.type == "cpu" and r.dtype == torch.float32
                                                    and r.stride(-1) == 1 for r in rows):
            b, V = len(rows), rows[0].shape[-1]
            zero, top_k, one = array("f", bytes(4 * b)), array("i", bytes(4 * b)), array("f", [1.0] * b)
            settings = tuple(a.buffer_info()[0] for a in (zero, top_k, one, zero))  # (temperature 0: greedy)
            return self.kernel([r.data_ptr() for r in rows], V, settings, [0.0] * b)[0].tolist()
        return [int(r.argmax()) for r in rows]

    def _logprobs(self, logits: torch.Tensor, meta: SamplingMetadata, results: list[SampleResult]) -> None:
        """Fill the log-probabilities of `results` (the rows drawn already) that ask."""
        if not meta.logprob_rows:
            return
        tokens = torch.tensor([r.token for r in results], device=logits.device)  # (a failed row's -1: clamped, ignored)
        filled, _ = self._logprob_tensors(logits, SampleLaunch(meta, tokens, [])).results()
        for i in meta.logprob_rows:
            results[i].logprob, results[i].top_logprobs = filled[i].logprob, filled[i].top_logprobs

    @staticmethod
    def _logprob_tensors(logits: torch.Tensor, out: SampleLaunch) -> SampleLaunch:
        """Log-probabilities of the raw logits for the rows that ask, of `out`'s tokens and the
        top n: one log_softmax, one gather, one topk, as tensors in `out`."""
        lr = out.meta.logprob_rows
        if not lr:
            return out
        whole = len(lr) == logits.shape[0]
        sel = slice(None) if whole else to_device(lr, torch.long, logits.device)
        lp = logits[sel].float().log_softmax(-1)
        out.chosen = lp.gather(1, out.tokens[sel].clamp(min=0)[:, None])[:, 0]
        if out.meta.max_logprobs:
            out.top_vals, out.top_ids = lp.topk(out.meta.max_logprobs, dim=-1)
        return out

    # -- whole distributions ------------------------------------------------------------------
    def distributions(self, logits: torch.Tensor, rows: list[SamplerRequest],
                      histories: list[list[int]] | None = None) -> list[tuple]:
        """The distribution each row's token is drawn from, for rows of logits ``[n, vocab]``:
        ``(kept bool [vocab], probs float32 [vocab])``, or ``(argmax token, None)`` for a greedy
        row; after the processors with `histories` (each row's output ids, then any tokens ahead
        of them, e.g. drafts; the rows' own output ids by default), the grammar, temperature and
        filters. Speculative verification, the draft model and the inspector use it."""
        histories = histories or [r.output_ids for r in rows]
        which = [i for i, (r, h) in enumerate(zip(rows, histories)) if needs_edits(r.params, len(h))]
        work = self._process(logits, rows, which, histories)
        source = {i: work[j] for j, i in enumerate(which)}
        for i, r in enumerate(rows):
            if r.grammar is not None:
                source[i] = self._masked(logits[i], source.get(i), r, histories[i])
        return self._final(logits, rows, source)

    def distribution(self, logits: torch.Tensor, row: SamplerRequest, output_ids: list[int] | None = None):
        """`distributions` for one row of logits ``[vocab]``, with `output_ids` as its history."""
        return self.distributions(logits[None], [row], None if output_ids is None else [output_ids])[0]

