"""Which adapter a request uses (`LoRARequest`, vLLM's), and ``--lora-modules NAME=PATH``."""

from __future__ import annotations

from dataclasses import dataclass

from nextoken.errors import InvalidRequest


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: which adapter a request uses. `lora_int_id` >= 1 names it in the engine."""

    lora_name: str
    lora_int_id: int
    lora_path: str


def parse_lora_modules(items: list[str]) -> list[LoRARequest]:
    """``--lora-modules NAME=PATH ...`` as `LoRARequest`s with ids 1, 2, ...; `InvalidRequest`
    for an item without ``=`` or a name given twice."""
    out: dict[str, LoRARequest] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InvalidRequest(f"--lora-modules takes NAME=PATH items, got {item!r}", "lora_modules")
        if name in out:
            raise InvalidRequest(f"--lora-modules names {name!r} twice", "lora_modules")
        out[name] = LoRARequest(name, len(out) + 1, path)
    return list(out.values())
