"""``nextoken pull``, ``models`` and ``bench``: the catalog, and measuring a model."""

from __future__ import annotations

from nextoken.cli.common import engine_args


def cmd_pull(a) -> int:
    from nextoken.catalog import pull

    path = pull(a.name, force=a.force)
    print(path)
    return 0


def cmd_models(a) -> int:
    from nextoken.catalog import cache_dir, list_models

    print(f"{'NAME':<30} {'ARCH':<7} {'SIZE':>9}  {'CACHED':<6} DESCRIPTION")
    for m in list_models():
        print(f"{m['name']:<30} {m['architecture']:<7} {m['size'] / 2**20:>7.1f}Mi  {'yes' if m['cached'] else 'no':<6} "
              f"{m['description']}")
    print(f"cache: {cache_dir()}")
    return 0


def cmd_bench(a) -> int:
    from nextoken.bench import run

    return run(a, engine_args(a))
