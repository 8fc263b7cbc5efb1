"""The weights' arena of 2 MiB pages (`nextoken.runner.huge_pages`): the same outputs bit for bit,
every linear weight inside it, a tied table shared, an untied embedding left where it was."""

from __future__ import annotations

import pytest
import torch

from nextoken.layers.quantization.qweight import QuantWeight
from nextoken.loader.gguf import GGUFFile
from nextoken.loader.hf import HFModelDir
from nextoken.runner.huge_pages import QWEIGHT_FIELDS
from nextoken.runner.model_runner import ModelRunner
from tests.tiny_models import OneSequence, tiny_hf_model, write_gguf

QUANT = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q8_0", "attn_output.weight": "Q5_0",
         "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q8_0", "ffn_down.weight": "Q5_1", "token_embd.weight": "Q8_0"}
PROMPT = [5, 17, 200, 33, 41, 270, 90, 12]


@pytest.fixture(autouse=True)
def _arena(huge_pages_on):
    """The arena as a user's loads make it (the suite's other loads go without: conftest's NO_ARENA)."""


def inside(t: torch.Tensor, arena) -> bool:
    return arena.address <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= arena.address + arena.nbytes


def steps(runner) -> list[torch.Tensor]:
    seq = OneSequence(runner, 64, block_size=4)
    out = [seq.forward(PROMPT, all_logits=True)]
    for t in (3, 99, 240, 18, 7):
        out.append(seq.forward([t]))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied table (llama), untied embedding and head (qwen2)
def test_arena_holds_every_linear_and_changes_no_output(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_gguf(tiny_hf_model(arch, seed=5, vocab_size=320), path, arch, quant=QUANT)
    ModelRunner(GGUFFile(path), torch.bfloat16, prepared_cache=True)  # writes the prepared-weights cache
    placed = ModelRunner(GGUFFile(path), torch.bfloat16, prepared_cache=True)  # copies out of its mapping
    plain = ModelRunner(GGUFFile(path), torch.bfloat16, huge_pages=False)
    arena = placed.weights_arena
    assert arena is not None and plain.weights_arena is None
    assert placed.native_decoder is not None  # the C decode step reads the arena too
    assert "weights " in placed.plan.describe(placed.model)
    assert "huge pages off" in plain.plan.describe(plain.model)
    linears = [m for m in placed.model.modules() if getattr(m, "qweight", None) is not None and hasattr(m, "float_out")]
    assert len(linears) >= 7
    for lin in linears:
        assert all(inside(getattr(lin.qweight, f), arena) for f in QWEIGHT_FIELDS if getattr(lin.qweight, f) is not None)
    emb, head = placed.model.embed_tokens.qweight, placed.model.lm_head
    assert isinstance(emb, QuantWeight)
    if arch == "llama":  # the table is the head's weight: in the arena once, shared
        assert head.qweight is emb and inside(emb.codes, arena)
    else:  # a lookup table alone stays in the mapped file; the (dense) head moves
        assert not inside(emb.codes, arena) and inside(head.weight, arena)
    for a, b in zip(steps(placed), steps(plain)):
        assert torch.equal(a, b)


def test_dense_weights_move_too(tmp_path):
    """A Hugging Face folder's bf16 linears (our dense kernel) go into the arena as well."""
    hf = tiny_hf_model("qwen2", seed=6, vocab_size=320)
    hf.save_pretrained(tmp_path / "folder", safe_serialization=True)
    placed = ModelRunner(HFModelDir(str(tmp_path / "folder")), torch.bfloat16)
    plain = ModelRunner(HFModelDir(str(tmp_path / "folder")), torch.bfloat16, huge_pages=False)
    arena = placed.weights_arena
    layer = placed.model.layers[0]
    assert inside(layer.mlp.down_proj.weight, arena) and inside(placed.model.lm_head.weight, arena)
    assert isinstance(layer.mlp.down_proj.weight, torch.nn.Parameter)
    for a, b in zip(steps(placed), steps(plain)):
        assert torch.equal(a, b)


def test_the_environment_can_keep_the_weights_off_the_arena(tmp_path, monkeypatch):
    """``NEXTOKEN_HUGE_PAGES=0``: no arena whatever ``huge_pages`` says, and the plan names the switch."""
    monkeypatch.setenv("NEXTOKEN_HUGE_PAGES", "0")
    path = tmp_path / "llama.gguf"
    write_gguf(tiny_hf_model("llama", seed=5, vocab_size=320), path, "llama", quant=QUANT)
    runner = ModelRunner(GGUFFile(path), torch.bfloat16, huge_pages=True)
    assert runner.weights_arena is None
    assert "huge pages off: NEXTOKEN_HUGE_PAGES=0" in runner.plan.describe(runner.model)


def test_no_arena_where_the_system_has_transparent_huge_pages_off(tmp_path, monkeypatch):
    """`never`: the copy would buy nothing; the weights stay where they were loaded and the plan says why."""
    import nextoken.runner.huge_pages as huge_pages

    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    import nextoken.runner.model_runner as model_runner

    monkeypatch.setattr(model_runner, "thp_mode", lambda: "never")
    path = tmp_path / "llama.gguf"
    write_gguf(tiny_hf_model("llama", seed=5, vocab_size=320), path, "llama", quant=QUANT)
    runner = ModelRunner(GGUFFile(path), torch.bfloat16)
    assert runner.weights_arena is None
    assert "huge pages off: transparent huge pages are never here" in runner.plan.describe(runner.model)



@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16])
@pytest.mark.parametrize("where", ["off a page", "in a piece's last page"])
def test_a_mapped_tensor_is_copied_in_pieces_each_dropped_after_its_copy(tmp_path, monkeypatch, dtype, where):
    """The copy out of a mapped file goes piece by piece (here 64 KiB, over an unaligned 1 MiB
    tensor): each piece's pages faulted in, copied, then dropped, the drops covering the tensor's
    whole pages, so a large table is never resident twice; the bytes are the file's. A tensor
    that starts in the last page before a piece's end has a first piece of no whole page."""
    import mmap

    import numpy as np

    import nextoken.runner.huge_pages as huge_pages

    chunk, page = 64 << 10, mmap.PAGESIZE
    monkeypatch.setattr(huge_pages, "COPY_CHUNK", chunk)
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda a, n, advice: calls.append((advice, a, n)))
    data = np.random.default_rng(0).integers(0, 256, (1 << 20) + 2 * chunk, dtype=np.uint8)
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    n = 1 << 20  # from an even offset (bf16) off the page boundary, or 100 bytes before a piece's end
    start = page + 38 if where == "off a page" else (chunk - 100 - whole.data_ptr()) % chunk
    t = whole[start : start + n].view(dtype)
    dst = torch.empty(n, dtype=torch.uint8)
    huge_pages._copy_bytes(t, dst, mapped=True)
    assert np.array_equal(dst.numpy(), data[start : start + n])
    base = t.data_ptr()
    reads = [(a, m) for advice, a, m in calls if advice == huge_pages.MADV_POPULATE_READ]
    drops = [(a, m) for advice, a, m in calls if advice == mmap.MADV_DONTNEED]
    assert len(reads) + len(drops) == len(calls)
    for before, (advice, a, m) in zip(calls, calls[1:]):  # a drop right after its piece's copy, inside it
        if advice == mmap.MADV_DONTNEED:
            assert before[0] == huge_pages.MADV_POPULATE_READ and before[1] <= a and a + m <= before[1] + before[2]
    assert reads[0][0] == base and sum(n for _, n in reads) == n and all(n <= chunk for _, n in reads)
    assert all(a % chunk == 0 for a, _ in reads[1:])  # the pieces end on the chunk's multiples
    first, last = -(-base // page) * page, (base + n) // page * page
    assert drops[0][0] == first and drops[-1][0] + drops[-1][1] == last
    assert all(a + m == b for (a, m), (b, _) in zip(drops, drops[1:]))  # every whole page dropped once
    del t
    buf.close()
