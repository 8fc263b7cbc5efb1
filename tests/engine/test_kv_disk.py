"""The prefix cache's disk tier (`nextoken.kv_cache.disk`): block files, their checks, sharing
between processes, the size limit, faults that must leave serving alone, and the engine reading
back what an earlier engine wrote."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nextoken.kv_cache.disk import DiskKVStore, chain_key, decode_block

IDENTITY = {"model": "a" * 64, "dtype": "torch.bfloat16", "kv_cache_dtype": "auto", "block_size": 4}
BLOCK = 1000  # payload bytes


def payload(i: int, n: int = BLOCK) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(n))


def blocks(store: DiskKVStore, count: int, first: int = 0):
    """`count` chained blocks of 4 tokens: (key, tokens, payload) each."""
    out, parent = [], None
    for i in range(first, first + count):
        toks = tuple(range(4 * i, 4 * i + 4))
        key = chain_key(store.namespace, parent, toks)
        out.append((key, toks, payload(i, store.block_bytes)))
        parent = key
    return out


def write_all(store: DiskKVStore, items) -> None:
    for key, toks, data in items:
        store.offer(key, toks, lambda data=data: data)
    store.flush()


def test_a_block_written_is_read_back_by_another_store(tmp_path):
    a = DiskKVStore(tmp_path, 1 << 20, IDENTITY, BLOCK)
    items = blocks(a, 3)
    write_all(a, items)
    b = DiskKVStore(tmp_path, 1 << 20, IDENTITY, BLOCK)  # a restarted process
    for key, toks, data in items:
        assert b.contains(key)
        assert bytes(b.read(key, toks)) == data
    assert b.stats["hits"] == 3 and b.stats["errors"] == 0
    assert a.stats["blocks_written"] == 3 and not list((tmp_path / "tmp").iterdir())


def test_chain_keys_name_the_whole_prefix():
    ns = b"n" * 16
    k1 = chain_key(ns, None, (1, 2))
    assert chain_key(ns, k1, (3, 4)) != chain_key(ns, chain_key(ns, None, (9, 2)), (3, 4))
    assert chain_key(ns, None, (1, 2)) == k1 and chain_key(b"m" * 16, None, (1, 2)) != k1


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_file_is_skipped_counted_and_removed(tmp_path, caplog, damage):
    store = DiskKVStore(tmp_path, 1 << 20, IDENTITY, BLOCK)
    (key, toks, data), = blocks(store, 1)
    write_all(store, [(key, toks, data)])
    path = store.path(key)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
    elif damage == "truncate":
        raw = raw[:-7]
    else:
        raw = bytearray()
    path.write_bytes(raw)
    fresh = DiskKVStore(tmp_path, 1 << 20, IDENTITY, BLOCK)
    with caplog.at_level(logging.WARNING, "nextoken.kv_cache"):
        assert fresh.read(key, toks) is None
    assert fresh.stats["errors"] == 1 and fresh.stats["hits"] == 0
    assert "skipped KV block file" in caplog.text and not path.exists()


def test_a_key_collision_with_other_tokens_is_not_used(tmp_path):
    store = DiskKVStore(tmp_path, 1 << 20, IDENTITY, BLOCK)
    (key, toks, data), = blocks(store, 1)
    write_all(store, [(key, toks, data)])
    assert store.read(key, (9, 9, 9, 9)) is None and store.stats["errors"] == 1


@pytest.mark.parametrize("change", [{"model": "b" * 64}, {"dtype": "torch.float32"},
                                    {"kv_cache_dtype": "int8"}, {"shard": [1, 2]}])
def test_another_models_dtypes_or_shards_blocks_are_never_read(tmp_path, change):
    mine = DiskKVStore(tmp_path, 1 << 20, IDENTITY, BLOCK)
    items = blocks(mine, 2)
    write_all(mine, items)
    other = DiskKVStore(tmp_path, 1 << 20, {**IDENTITY, **change}, BLOCK)
    assert other.root != mine.root
    key, toks, _ = items[0]
    assert not other.contains(key)  # other keys (the namespace starts the chain), in another folder
    other_key = blocks(other, 1)[0][0]
    other.path(other_key).parent.mkdir(parents=True, exist_ok=True)
    os.link(mine.path(key), other.path(other_key))  # even a file moved into its place is refused
    assert other.read(other_key, toks) is None and other.stats["errors"] == 1


def test_the_size_limit_evicts_the_least_recently_used(tmp_path):
    store = DiskKVStore(tmp_path, 10 << 20, IDENTITY, BLOCK)
    items = blocks(store, 5)
    write_all(store, items)
    now = time.time()
    for age, (key, _, _) in zip((50, 40, 30, 20, 10), items):  # block 0 oldest ... block 4 newest
        os.utime(store.path(key), (now - age, now - age))
    assert store.read(items[0][0], items[0][1]) is not None  # a read makes block 0 the newest
    file_size = store.path(items[0][0]).stat().st_size
    small = DiskKVStore(tmp_path, int(4.5 * file_size), IDENTITY, BLOCK)  # room for 4 of 6: 90% of it
    write_all(small, blocks(small, 1, first=5))
    left = [store.path(k).exists() for k, _, _ in items]
    assert left == [True, False, False, True, True], left


def test_a_block_larger_than_the_limit_is_dropped(tmp_path):
    store = DiskKVStore(tmp_path, 100, IDENTITY, BLOCK)
    items = blocks(store, 2)
    write_all(store, items)
    assert store.stats["dropped"] == 2 and not store.contains(items[0][0])


def test_an_unwritable_directory_leaves_a_working_store(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING, "nextoken.kv_cache"):
        store = DiskKVStore(tmp_path / "file" / "kv", 1 << 20, IDENTITY, BLOCK)
    assert not store.writable and "serving goes on from RAM" in caplog.text
    key, toks, data = blocks(store, 1)[0]
    write_all(store, [(key, toks, data)])
    assert store.read(key, toks) is None and store.stats["dropped"] == 1


WRITER = textwrap.dedent("""
    import sys
    from nextoken.kv_cache.disk import DiskKVStore, chain_key
    directory, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store = DiskKVStore(directory, 1 << 40, {"model": "w"}, size)
    data = bytes(range(256)) * (size // 256)
    parent = None
    for i in range(count):
        toks = (i, i + 1)
        parent = chain_key(store.namespace, parent, toks)
        store.offer(parent, toks, lambda: data)
        store.flush()
    print("done", flush=True)
""")


def check_every_file(directory, size: int, count: int) -> int:
    """Read every block a `WRITER` run may have written; returns how many it had. A file that
    exists must be whole and correct."""
    store = DiskKVStore(directory, 1 << 40, {"model": "w"}, size)
    data, parent, found = bytes(range(256)) * (size // 256), None, 0
    for i in range(count):
        toks = (i, i + 1)
        parent = chain_key(store.namespace, parent, toks)
        if store.path(parent).exists():
            got = store.read(parent, toks)
            assert got is not None and bytes(got) == data, i
            found += 1
    assert store.stats["errors"] == 0
    return found


def test_two_processes_write_the_same_blocks_at_once(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "200", str(64 << 10)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and "done" in out
    assert check_every_file(tmp_path, 64 << 10, 200) == 200
    assert not list((tmp_path / "tmp").iterdir())


def test_a_process_killed_mid_write_leaves_nothing_that_is_read(tmp_path):
    """A real ``kill -9`` while a writer streams 32 MiB blocks, sent once a temporary file exists: every file under its final name is
    whole, the half-written one stays a temporary file, and a later store deletes it once stale."""
    size, killed_mid_write = 32 << 20, False
    for attempt in range(5):
        d = tmp_path / str(attempt)
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(d), "10000", str(size)])
        deadline = time.time() + 60
        while time.time() < deadline and len(list(d.glob("*/*/*.kv"))) < 3:
            time.sleep(0.05)
        while time.time() < deadline and not list((d / "tmp").glob("*.tmp")):  # kill while a file is half-written
            pass
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        check_every_file(d, size, 10000)
        tmps = list((d / "tmp").iterdir())
        if tmps:
            killed_mid_write = True
            old = time.time() - 7200
            for t in tmps:
                os.utime(t, (old, old))
            store = DiskKVStore(d, 1 << 40, {"model": "w"}, size)
            store.flush()  # the writer thread cleans stale temporary files first
            deadline = time.time() + 10
            while time.time() < deadline and list((d / "tmp").iterdir()):
                time.sleep(0.05)
            assert not list((d / "tmp").iterdir())
            break
    assert killed_mid_write, "no kill landed in the middle of a write in 5 tries"


def test_decode_checks_the_size_before_anything_else():
    with pytest.raises(ValueError, match="truncated"):
        decode_block(bytearray(10), b"n" * 16, b"k" * 16, (1,), 5)


# -- the engine over the disk tier (SmolLM2) ----------------------------------------------------
PROMPT = "A long shared system prompt: answer briefly, cite the source, and stay polite. " * 8
SETTINGS = dict(max_model_len=1024, max_num_seqs=2, kv_cache_memory="64MiB")


def greedy(llm, prompt: str = PROMPT) -> str:
    from nextoken import SamplingParams

    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text


def run_engine(path, **kwargs):
    """Greedy text of `PROMPT` from a fresh engine (a restart), and its `SchedulerStats` after its writes."""
    from nextoken import LLM

    llm = LLM(str(path), **SETTINGS, **kwargs)
    try:
        text = greedy(llm)
    finally:
        llm.close()  # waits for the disk tier's writes
    return text, llm.engine.scheduler_stats()


def scrape(stats) -> dict[str, float]:
    """The server's /metrics text for these engine stats (a `SchedulerStats`), as name{labels} -> value."""
    from nextoken.server.app.metrics import ServerMetrics

    text = ServerMetrics("m", lambda: stats).render().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_a_restart_reads_the_blocks_back_and_answers_the_same(smollm2_path, tmp_path):
    """bf16 then int8 KV in one directory: each first engine writes its blocks, each restart reads
    them back instead of recomputing, and every answer equals the engine's without the tier. The
    int8 engine's first run finds nothing of the bf16 blocks (another namespace)."""
    for kv_dtype in ("auto", "int8"):
        reference, _ = run_engine(smollm2_path, kv_cache_dtype=kv_dtype)
        text, first = run_engine(smollm2_path, kv_cache_dtype=kv_dtype, kv_cache_dir=str(tmp_path))
        assert text == reference and first.disk.hits == 0 and first.disk.blocks_written > 0
        text, again = run_engine(smollm2_path, kv_cache_dtype=kv_dtype, kv_cache_dir=str(tmp_path))
        assert text == reference, kv_dtype
        prompt_blocks = again.prefix_cache_queries // 16  # every full block but the last token's
        assert again.disk.hits >= prompt_blocks - 1 and again.disk.errors == 0
        assert again.prefix_cache_hits == again.disk.hit_tokens > 0
        metrics = scrape(again)
        assert metrics["nextoken_kv_disk_hits_total"] == again.disk.hits
        assert metrics['vllm:external_prefix_cache_hits_total{model_name="m"}'] == again.disk.hit_tokens
    assert len([d for d in tmp_path.iterdir() if d.name != "tmp"]) == 2  # one namespace per KV dtype


def test_a_disk_that_cannot_take_the_blocks_keeps_serving(smollm2_path, tmp_path):
    reference, _ = run_engine(smollm2_path)
    (tmp_path / "file").write_text("not a directory")
    text, stats = run_engine(smollm2_path, kv_cache_dir=str(tmp_path / "file" / "kv"))
    assert text == reference and stats.disk.errors >= 1 and stats.disk.blocks_written == 0
    text, stats = run_engine(smollm2_path, kv_cache_dir=str(tmp_path / "tiny"), kv_cache_disk="1KiB")
    assert text == reference and stats.disk.dropped > 0 and stats.disk.blocks_written == 0


def test_the_tier_is_asked_for_by_either_flag_and_refused_where_it_cannot_work(tmp_path, monkeypatch):
    from nextoken.engine_args import EngineArgs
    from nextoken.errors import InvalidRequest

    monkeypatch.setenv("NEXTOKEN_CACHE", str(tmp_path))
    assert EngineArgs().disk_dir is None and EngineArgs(kv_cache_dir="off").disk_dir is None
    assert EngineArgs(kv_cache_disk="2GiB").disk_dir == str(tmp_path / "kv")
    args = EngineArgs(kv_cache_dir="/x", kv_cache_disk="2GiB")
    assert args.cache_config().disk_dir == "/x" and args.cache_config().disk_bytes == 2 << 30
    from types import SimpleNamespace

    from nextoken.kv_cache.disk import open_disk_tier

    runner = SimpleNamespace(kv=None, plan=None, model=SimpleNamespace(config=None), tp=SimpleNamespace(rank=0))
    with pytest.raises(InvalidRequest, match="tensor parallelism") as e:  # refused when the engine is built
        open_disk_tier(args.cache_config(), runner, "a" * 64)
    assert e.value.field == "kv_cache_dir"
    with pytest.raises(InvalidRequest) as e:
        EngineArgs(kv_cache_disk="lots")
    assert e.value.field == "kv_cache_disk"


def test_a_sliding_window_model_reads_its_blocks_back_after_a_restart(tiny_gguf, tmp_path):
    """Gemma 3 (window 8, blocks of 4): the full-attention layers' blocks and the sliding-window
    layers' own (another namespace) go to disk; a restarted engine reads a prompt's prefix back,
    both parts, and a longer history's, and answers as the engine without the prefix cache
    (float32: the same tokens, log-probabilities within 1e-4). With one sequence (no blocks to
    spare past the ring) a long prompt's early blocks keep no sliding part, so only the history
    is read back."""
    from nextoken import LLM, SamplingParams

    path = str(tiny_gguf["gemma3"][0])
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompt = [(7 * j) % 250 + 3 for j in range(30)]
    plain = LLM(path, dtype="float32", block_size=4, enable_prefix_caching=False)
    for seqs in (8, 1):
        kv_dir = tmp_path / f"seqs{seqs}"
        settings = dict(dtype="float32", block_size=4, max_num_seqs=seqs, kv_cache_dir=str(kv_dir))
        first = LLM(path, **settings)
        answer = first.generate([prompt], p)[0].outputs[0]
        first.close()
        assert len(list(kv_dir.iterdir())) == 3  # the two namespaces and tmp
        again = LLM(path, **settings)
        for turn, hit in [(prompt[:22] + [9, 9], 20 if seqs > 1 else 0), (prompt + answer.token_ids + [5, 6, 7], 32)]:
            a, b = again.generate([turn], p)[0], plain.generate([turn], p)[0]
            assert a.usage["cached_tokens"] == hit and a.outputs[0].token_ids == b.outputs[0].token_ids
            for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert all(abs(x[t] - y[t]) < 1e-4 for t in x.keys() & y.keys())
        assert again.engine.kv.disk_stats().hits > 0
        again.close()
