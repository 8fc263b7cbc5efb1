"""`SpecStats`: speculative decoding's counts since the start, as the engine reports them (no
PyTorch here: the server's processes read them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding since the start (zeros without it): drafted and accepted tokens,
    verifications (one per request and step), accepted / drafted, and tokens emitted per
    verification (accepted drafts plus one)."""

    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
