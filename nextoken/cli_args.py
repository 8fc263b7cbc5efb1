"""Options defined once, with their command-line form: the base of `EngineArgs` and
`server.args.ServerArgs`.

A field made with `opt` carries its default, its help text and its flag; `CliArgs` adds every
such field to a parser (`add_cli_args`), reads them back (`from_cli_args`), and writes the flags
that rebuild them for a child process (`to_cli_args`). This module imports no torch, so
``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import field
from typing import Any

from nextoken.errors import InvalidRequest


def opt(default: Any, help: str, flag: str | None = None, group: str = "model", cli: str = "value",
        short: str | None = None, quick_start: bool | tuple = False, aliases: tuple[str, ...] = (),
        **argparse_kwargs) -> Any:
    """A field with its command-line form: `flag` (default ``--field-name``; `short`, a one-letter
    alias; `aliases`, other long names: vLLM's spelling where ours differs), `cli` one of
    ``value`` (takes a value), ``true`` (a switch that sets True), ``bool`` (``--x/--no-x``),
    ``size`` (bytes given as ``512MiB``), or ``none`` (Python only). `quick_start`: the values
    with which ``run``'s quick start draws the engine's first token (True: any; a tuple: those;
    False, the default: only the field's default; `runner.quick_start.keeps_first_token`). A list
    default is copied for each instance."""
    meta = {"help": help, "flag": flag, "short": short, "group": group, "cli": cli, "argparse": argparse_kwargs,
            "quick_start": quick_start, "aliases": aliases}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def json_object(text: str) -> dict:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


class CliArgs:
    """A dataclass of `opt` fields, with its command line."""

    # -- command line ---------------------------------------------------------------------
    @classmethod
    def cli_fields(cls) -> list[dataclasses.Field]:
        """The fields that have a command-line flag."""
        return [f for f in dataclasses.fields(cls) if f.metadata["cli"] != "none"]

    @staticmethod
    def flag(f: dataclasses.Field) -> str:
        return f.metadata["flag"] or "--" + f.name.replace("_", "-")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (), **defaults) -> None:
        """Add every engine flag to `parser` (grouped as in ``--help``), with `defaults`
        overriding the field defaults, and none of the fields named in `exclude`."""
        groups: dict[str, Any] = {}
        for f in cls.cli_fields():
            if f.name in exclude:
                continue
            group = parser if f.metadata["group"] == "model" else groups.setdefault(
                f.metadata["group"], parser.add_argument_group(f.metadata["group"]))
            default = defaults.get(f.name, _default(f))
            kind, flag = f.metadata["cli"], cls.flag(f)
            quiet = default in (None, False, []) or kind == "true"
            shown = f.metadata["help"] + ("" if quiet else f" (default {default})")
            names = [flag, *([f.metadata["short"]] if f.metadata["short"] else []), *f.metadata["aliases"]]
            if kind == "true":
                group.add_argument(*names, dest=f.name, action="store_true", default=default, help=shown)
            elif kind == "bool":
                group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                   help=shown)
            elif kind == "size":
                group.add_argument(*names, dest=f.name, type=_cli_size, default=default, metavar="SIZE", help=shown)
            else:
                extra = dict(f.metadata["argparse"])
                if extra.get("type") is int:
                    extra.setdefault("metavar", "N")
                elif "choices" not in extra:
                    extra.setdefault("metavar", f.name.rsplit("_", 1)[-1].upper())
                group.add_argument(*names, dest=f.name, default=default, help=shown, **extra)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides):
        """The arguments of a parsed command line (fields without a flag keep their
        defaults unless given in `overrides`)."""
        values = {f.name: getattr(ns, f.name) for f in cls.cli_fields() if hasattr(ns, f.name)}
        return cls(**{**values, **overrides})

    def to_cli_args(self, exclude: tuple[str, ...] = ()) -> list[str]:
        """The flags that rebuild these arguments (for a child process): ``from_cli_args`` of
        their parse equals ``self`` on every field with a flag."""
        out: list[str] = []
        for f in self.cli_fields():
            if f.name in exclude:
                continue
            value, flag, kind = getattr(self, f.name), self.flag(f), f.metadata["cli"]
            if kind == "true":
                out += [flag] if value else []
            elif kind == "bool":
                if value is not None:  # (None: the field's default, decided where it is used)
                    out.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, list):
                out += [flag, *map(str, value)] if value else []
            elif isinstance(value, dict):
                out += [flag, json.dumps(value)]
            elif value is not None:
                out += [flag, str(value)]
        return out




def _cli_size(text: str) -> int:
    try:
        return parse_size(text)
    except InvalidRequest as e:
        raise argparse.ArgumentTypeError(str(e)) from None


SIZE_UNITS = {"": 1, "b": 1,
              "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
              "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40,
              "tib": 2**40}


def parse_size(text: str | int, field: str = "kv_cache_memory") -> int:
    """A size in bytes: a number, or a number with a unit. SI units are powers of 1000 (``k``,
    ``M``, ``G``, ``T``, with or without ``B``: ``2GB`` = 2 * 10^9), IEC units powers of 1024
    (``Ki``, ``Mi``, ``Gi``, ``Ti``, with or without ``B``: ``512MiB`` = 512 * 2^20); case does
    not matter. Raises `InvalidRequest` (naming `field`) for anything else or a size that is
    not positive."""
    t = str(text).strip()
    num = t.rstrip("bBiIkKmMgGtT")
    unit = t[len(num):].lower()
    try:
        value = float(num) * SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise InvalidRequest(f"cannot read size {text!r}: use a number of bytes or a unit, e.g. 512MiB, 2GiB "
                             "(powers of 1024) or 2GB (powers of 1000)", field) from None
    if value < 1:
        raise InvalidRequest(f"size {text!r} must be at least one byte", field)
    return int(value)
