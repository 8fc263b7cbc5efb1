"""The compiler's report on our Triton kernels (attention, the batch-invariant matmul and RMSNorm,
the GPU plan's row-wise activation, RoPE and residual add with RMSNorm, its GEMV and split-K GEMM,
and the sampler's draw) for a Hopper GPU (sm_90), made on a machine
without one: Triton compiles to a cubin with its own ptxas, its cuobjdump reads registers and
stack off it, and the PTX shows the matrix instructions and wide loads (METHOD.md: what costs no
device time).

    python -m tests.helpers.triton_report             # one JSON line per kernel variant
    python -m tests.helpers.triton_report --launches  # the other tiles and launches the plan times

Run in a process without ``TRITON_INTERPRET`` (the interpreter replaces the compiled kernel).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

SHAPES = [  # (dtype, query heads per KV head, head dim, decode, splits, flags): the catalog's shapes
    ("bf16", 3, 64, True, 4, ""), ("bf16", 3, 64, False, 1, ""),  # SmolLM2
    ("bf16", 6, 128, True, 4, ""), ("bf16", 6, 128, False, 1, ""),  # Qwen2.5-1.5B
    ("bf16", 4, 256, True, 16, "window"), ("bf16", 4, 256, False, 1, ""),  # Gemma 3 270M: global layers,
    ("bf16", 4, 256, False, 1, "window fresh"),  # and a sliding layer's prefill (its ring and the pass's rows),
    ("bf16", 4, 256, False, 1, "window fresh aligned"),  # (batch-invariant: the first new token's tile reads both)
    ("bf16", 3, 64, True, 1, "int8"), ("bf16", 6, 128, False, 1, "int8"),  # --kv-cache-dtype int8
    ("bf16", 7, 64, True, 4, "int8"), ("bf16", 4, 256, False, 1, "int8"),  # (Qwen2.5-0.5B: 7 per KV head)
    ("fp32", 3, 64, False, 1, ""), ("fp32", 6, 128, True, 4, ""), ("fp32", 6, 128, False, 1, ""),  # the float32
    ("fp32", 4, 256, False, 1, "window fresh"), ("fp32", 4, 256, False, 1, "window fresh aligned"),  # reference
]


def _other_tiles() -> list[tuple]:
    """Each shape with each tiling but the default that the plan may time for it
    (`attention.tilings`, by index)."""
    from nextoken.kernels.gpu.attention import tilings

    return [v + (i,) for v in SHAPES for i in range(1, len(tilings(v[3], v[1], v[2], v[0] == "fp32")))]


VARIANTS = [v + (0,) for v in SHAPES]  # the default tiles (`attention.tiling`)
TILES = _other_tiles()  # the others the plan times (``--launches``)
# the tensors' pointers and strides as Triton specializes a launch on the model's own (multiples of 16
# bytes and elements: `kv_cache.tensors.PagedKVCache`'s blocks, the heads' rows); its tables' may be any
ALIGNED = ("out_ptr", "part_ptr", "q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "kn_ptr", "vn_ptr", "stride_qt",
           "stride_qh", "stride_ot", "stride_oh", "stride_kh", "stride_kb", "stride_sh", "stride_sb", "stride_nt",
           "stride_nh")


def report(dtype: str, group: int, d: int, decode: bool, splits: int, flags: str = "", tile: int = 0) -> dict:
    """Registers, stack bytes, spill stores and tensor-core instructions of one compiled variant
    of the attention kernel, with the tiles ``attention.tilings(...)[tile]``; `flags`: any of
    ``int8`` (an int8 cache), ``window`` (a sliding window), ``fresh`` (the pass's own keys,
    `paged_attention`'s k_new), ``aligned`` (its `aligned`). Compiled as a launch specializes on
    the model's tensors (`ALIGNED`): without that, the paged loads' addresses are not known to be
    16-byte aligned, their tiles load element by element and take up to four times the
    registers (a 128-dim decode: 254 against 64)."""
    from nextoken.kernels.gpu import attention as A

    t = A.tilings(decode, group, d, dtype == "fp32")[tile]
    p = f"*{dtype}"
    kv = "*i8" if "int8" in flags else p
    types = {"out_ptr": p, "part_ptr": "*fp32" if splits > 1 else p, "tickets_ptr": "*i32", "q_ptr": p, "k_ptr": kv,
             "v_ptr": kv,
             "ks_ptr": "*fp32", "vs_ptr": "*fp32", "kn_ptr": p, "vn_ptr": p, "tables_ptr": "*i32",
             "seq_lens_ptr": "*i32", "q_start_ptr": "*i32", "qb_seq_ptr": "*i32", "qb_first_ptr": "*i32",
             "scale": "fp32", "softcap": "fp32"}
    consts = dict(GROUP=group, BLOCK_Q=t.block_q, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HEAD_DIM=d, BLOCK_SIZE=16,
                  DECODE=decode, SPLITS=splits, INT8="int8" in flags, FRESH="fresh" in flags, SOFTCAP=False,
                  WINDOW="window" in flags, WIDEN=False, ALIGNED="aligned" in flags, JOIN=decode and splits > 1)
    usage = compiled(A._attention_kernel, types, consts, t.num_warps, t.num_stages, ALIGNED)
    return {"variant": [dtype, group, d, decode, splits, flags, tile], **usage}


INVARIANT = [("linear", "bf16"), ("linear", "fp32"), ("rms_norm", "bf16", 2048), ("rms_norm", "fp32", 2048),
             ("rms_norm", "bf16", 128)]  # (hidden sizes up to 2048; Qwen 3's heads)


def report_invariant(kernel: str, dtype: str, width: int = 0) -> dict:
    """The same report for a batch-invariant kernel (`kernels.gpu.batch_invariant`): its linear
    (the one tile shape every call takes), or its RMSNorm over rows of `width`."""
    from nextoken.kernels.gpu import batch_invariant as B

    p = f"*{dtype}"
    if kernel == "linear":
        types = {"x_ptr": p, "w_ptr": p, "b_ptr": p, "out_ptr": p}
        consts = dict(BLOCK_M=B.BLOCK_M, BLOCK_N=B.BLOCK_N, BLOCK_K=B.BLOCK_K, HAS_BIAS=True, WIDEN=False, ROUND=False)
        usage = compiled(B._linear_kernel, types, consts, B.NUM_WARPS, B.NUM_STAGES)
    else:
        types = {"x_ptr": p, "w_ptr": p, "out_ptr": p, "eps": "fp32"}
        consts = dict(ROWS=B.norm_rows(width), BLOCK=width, GEMMA=False, ROUND=False)
        usage = compiled(B._rms_norm_kernel, types, consts, 4, 3, options=B.NO_FMA)
    return {"variant": [kernel, dtype, width], **usage}


ROWWISE = [("act", "bf16", 0), ("act", "bf16", 1), ("act", "fp32", 0), ("rope", "bf16", 32), ("rope", "bf16", 64),
           ("rope", "bf16", 128), ("rope", "fp32", 64), ("rope store", "bf16", 64), ("rope store", "bf16", 128),
           ("rope store", "fp32", 64), ("add_norm", "bf16", 2048), ("add_norm", "fp32", 2048),
           ("add_norm gemma", "bf16", 1024)]  # (act: SiLU 0, GELU 1; rope: half the rotated dims; add_norm: width)


def report_rowwise(kernel: str, dtype: str, n: int) -> dict:
    """The same report for a row-wise kernel of the GPU plan (`kernels.gpu.rowwise`): the gated
    activation (`n` 1: GELU), RoPE over heads of ``2 n`` rotated dims (``store``: writing the
    paged cache too), or the residual add and RMSNorm over rows of `n` (``gemma``: Gemma 3's
    post-norm of the addend first)."""
    from nextoken.kernels.gpu import batch_invariant as B, rowwise as R
    from nextoken.kernels.gpu.batch_invariant import norm_rows

    p = f"*{dtype}"
    if kernel == "act":
        types = {"g_ptr": p, "u_ptr": p, "out_ptr": p}
        consts = dict(BLOCK=R.ACT_BLOCK, GELU=bool(n), BF16=dtype == "bf16", ROUND=False)
        usage = compiled(R._act_mul_kernel, types, consts, 4, 3, options=B.NO_FMA)
    elif kernel.startswith("rope"):
        types = {"q_ptr": p, "k_ptr": p, "cos_ptr": p, "sin_ptr": p, "qo_ptr": p, "ko_ptr": p,  # (the model's tables)
                 "v_ptr": p, "kc_ptr": p, "vc_ptr": p, "slot_ptr": "*i64"}
        consts = dict(HALF=n, HALF_P2=n, REST=0, REST_P2=1, D_P2=2 * n, STORE="store" in kernel,
                      BF16=dtype == "bf16", ROUND=False)
        usage = compiled(R._rope_kernel, types, consts, 1, 3, options=B.NO_FMA)
    else:
        types = {"h_ptr": p, "a_ptr": p, "wa_ptr": p, "w_ptr": p, "s_ptr": p, "y_ptr": p, "eps": "fp32"}
        gemma = "gemma" in kernel
        consts = dict(ROWS=norm_rows(n), BLOCK=n, NORM_A=gemma, NORM_OUT=True, GEMMA=gemma, BF16=dtype == "bf16",
                      ROUND=False)
        usage = compiled(R._add_norm_kernel, types, consts, 4, 3, options=B.NO_FMA)
    return {"variant": [kernel, dtype, n], **usage}


def _gemv_launches() -> list[int]:
    """The indices in `gemv.LAUNCHES` of the launches that compile differently (a tile or warps of
    their own; the rows per program are the report's own axis)."""
    from nextoken.kernels.gpu.gemv import LAUNCHES

    kinds = {}
    for i, launch in enumerate(LAUNCHES):
        kinds.setdefault((launch.tile, launch.num_warps), i)
    return sorted(kinds.values())


GEMV = [("gemv", "bf16", 1, 4, 0), ("gemv", "bf16", 2, 4, 0), ("gemv", "bf16", 4, 4, 0), ("gemv", "bf16", 1, 2, 0),
        ("gemv", "bf16", 4, 2, 0), ("gemv", "bf16", 1, 1, 0), ("gemv", "bf16", 4, 1, 0), ("gemv", "fp32", 1, 4, 0),
        ("gemv", "fp32", 4, 1, 0), ("gemv silu", "bf16", 1, 2, 0), ("gemv silu", "bf16", 1, 1, 0),
        ("gemv silu", "bf16", 4, 2, 0), ("gemv rope", "bf16", 1, 2, 0), ("gemv rope", "bf16", 4, 2, 0),
        ("gemv rope", "bf16", 1, 2, 2), ("gemv norm", "bf16", 1, 2, 0), ("gemv norm", "bf16", 4, 2, 0),
        ("gemv norm silu", "bf16", 1, 2, 0), ("gemv norm gemma", "bf16", 1, 4, 0)]
# (silu: the down projection's, SwiGLU's product read from gate and up; rope: the q/k/v product with
# RoPE and the cache's write, two features a program; norm: the residual add and RMSNorm joined by
# the last program, over Qwen2.5-1.5B's 1536 features, or Gemma 3 270M's 640 with its post-norm)
# (input rows, padded to a power of two; output features per program; the launch's index in `gemv.LAUNCHES`)
GEMV_LAUNCHES = [("gemv", "bf16", m, rows, i) for i in _gemv_launches() if i
                 for m, rows in ((1, 1), (1, 4), (4, 1), (4, 4))]  # the other launches the plan times


def report_gemv(kernel: str, dtype: str, m_pad: int, rows: int, launch: int) -> dict:
    """The same report for the GPU plan's GEMV (`kernels.gpu.gemv`) at `m_pad` input rows and
    `rows` output features per program, launched as ``gemv.LAUNCHES[launch]`` (its K chunk as
    `gemv.gemv` sets it), with a bias (``gemv silu``: none, its input SwiGLU's product); its pointers, K and strides taken as multiples of 16, as
    Triton specializes them at a launch with the catalog's shapes, so that the 16-byte loads
    show."""
    from nextoken.kernels.gpu import gemv as G
    from nextoken.kernels.gpu.batch_invariant import NO_FMA, norm_rows
    from nextoken.kernels.gpu.ints import next_power_of_2

    p = f"*{dtype}"
    how = G.LAUNCHES[launch]
    if kernel == "gemv rope":  # (Qwen2.5-1.5B's heads: 128 dims, all rotated; its biases)
        types = {"x_ptr": p, "w_ptr": p, "b_ptr": p, "out_ptr": p, "order_ptr": "*i32", "cos_ptr": p, "sin_ptr": p,
                 "kc_ptr": p, "vc_ptr": p, "slot_ptr": "*i64"}
        consts = dict(M_PAD=m_pad, PAIRS=rows // 2, BLOCK_K=how.tile // 2, HAS_BIAS=True, HALF=64, HEAD_DIM=128,
                      STORE=True, ROUND=False)
        aligned = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "order_ptr", "cos_ptr", "sin_ptr", "kc_ptr", "vc_ptr",
                   "slot_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om", "stride_c", "stride_ch")
        usage = compiled(G._gemv_rope_kernel, types, consts, how.num_warps, G.NUM_STAGES, aligned, options=NO_FMA)
        return {"variant": [kernel, dtype, m_pad, rows, launch], **usage}
    if kernel.startswith("gemv norm"):
        gemma, silu = kernel.endswith("gemma"), kernel.endswith("silu")
        n = 640 if gemma else 1536
        types = {k: p for k in ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "u_ptr", "h_ptr", "wa_ptr", "nw_ptr", "s_ptr",
                                "y_ptr")}
        types.update(ticket_ptr="*i32", eps="fp32")
        consts = dict(M_PAD=m_pad, ROWS=rows, BLOCK_K=how.tile // rows, HAS_BIAS=False, SILU_MUL=silu,
                      NORM_ROWS=norm_rows(n), BLOCK_N=next_power_of_2(n), NORM_A=gemma, NORM_OUT=True, GEMMA=gemma,
                      ROUND=False)
        aligned = (*types, "N", "K", "stride_xm", "stride_wn", "stride_um", "stride_h")
        usage = compiled(G._gemv_add_norm_kernel, {**types, "eps": "fp32"}, consts, how.num_warps, G.NUM_STAGES,
                         tuple(a for a in aligned if a != "eps"), options=NO_FMA)
        return {"variant": [kernel, dtype, m_pad, rows, launch], **usage}
    types = {"x_ptr": p, "w_ptr": p, "b_ptr": p, "out_ptr": p, "u_ptr": p}
    silu = kernel == "gemv silu"
    consts = dict(M_PAD=m_pad, ROWS=rows, BLOCK_K=how.tile // rows, HAS_BIAS=not silu, SILU_MUL=silu,
                  BF16=dtype == "bf16", ROUND=False)
    aligned = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "u_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om",
               "stride_um")
    usage = compiled(G._gemv_kernel, types, consts, how.num_warps, G.NUM_STAGES, aligned)
    return {"variant": [kernel, dtype, m_pad, rows, launch], **usage}


def _skinny_launches() -> list[int]:
    """The indices in `skinny.LAUNCHES` of the launches that compile differently (the splits
    per multiprocessor change the grid alone)."""
    from nextoken.kernels.gpu.skinny import LAUNCHES

    kinds = {}
    for i, launch in enumerate(LAUNCHES):
        kinds.setdefault((launch.block_n, launch.block_k, launch.num_warps, launch.num_stages), i)
    return sorted(kinds.values())


SKINNY = [("skinny", "bf16", 16, 0, 0), ("skinny", "bf16", 32, 0, 0), ("skinny", "bf16", 64, 0, 0),
          ("skinny", "bf16", 16, 1, 0), ("skinny", "bf16", 64, 1, 0), ("skinny_sum", "bf16", 0, 1, 0)]
# (rows padded, split-K, the launch's index in `skinny.LAUNCHES`)
SKINNY_LAUNCHES = [("skinny", "bf16", m, 1, i) for i in _skinny_launches() if i for m in (16, 64)]


def report_skinny(kernel: str, dtype: str, m_pad: int, split: int, launch: int) -> dict:
    """The same report for the GPU plan's split-K GEMM of 5-64 rows (`kernels.gpu.skinny`) at
    `m_pad` rows, launched as ``skinny.LAUNCHES[launch]``, writing the output or (`split`) the
    float32 partial sums, with a bias; or the sum of the splits (``skinny_sum``); pointers, K, N
    and strides taken as multiples of 16."""
    from nextoken.kernels.gpu import skinny as S

    p = f"*{dtype}"
    if kernel == "skinny_sum":
        types = {"part_ptr": "*fp32", "b_ptr": p, "out_ptr": p}
        usage = compiled(S._reduce_kernel, types, dict(BLOCK=S.REDUCE_BLOCK, HAS_BIAS=True, ROUND=False), 4, 3,
                         ("part_ptr", "b_ptr", "out_ptr", "N", "stride_om"))
    else:
        types = {"x_ptr": p, "w_ptr": p, "b_ptr": p, "out_ptr": p, "part_ptr": "*fp32"}
        how = S.LAUNCHES[launch]
        consts = dict(BLOCK_M=m_pad, BLOCK_N=how.block_n, BLOCK_K=how.block_k, SPLIT=bool(split), HAS_BIAS=True,
                      WIDEN=False, ROUND=False)
        aligned = ("x_ptr", "w_ptr", "b_ptr", "out_ptr", "part_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om",
                   "k_split")
        usage = compiled(S._skinny_kernel, types, consts, how.num_warps, how.num_stages, aligned)
    return {"variant": [kernel, dtype, m_pad, split, launch], **usage}


SAMPLING = [("draw", "fp32"), ("draw cached", "fp32")]  # the sampler's draw over float32 logits (cached: its
# keys and e^x written once to scratch, the default)


def report_sampling(kernel: str, dtype: str) -> dict:
    """The same report for the GPU sampler's draw (`kernels.gpu.sampling`), compiled as it
    launches (its tile, CUDA's expf), the logits' pointer, row stride and vocabulary taken as
    multiples of 16 as the catalog's are (151,936, 49,152, 262,144), so that 16-byte loads show."""
    from nextoken.kernels.gpu import sampling as S

    types = {"l_ptr": f"*{dtype}", "t_ptr": "*fp32", "k_ptr": "*i32", "p_ptr": "*fp32", "mp_ptr": "*fp32",
             "u_ptr": "*fp32", "out_ptr": "*i64", "kc_ptr": "*i32", "ec_ptr": "*fp32"}
    usage = compiled(S._draw_kernel, types, dict(TILE=S.TILE, CACHED=kernel == "draw cached", INTERPRET=False),
                     S.NUM_WARPS, 3, ("l_ptr", "stride_l", "V", "kc_ptr", "ec_ptr", "stride_c"))
    return {"variant": [kernel, dtype], **usage}


def compiled(fn, types: dict, consts: dict, num_warps: int, num_stages: int, aligned: tuple = (),
             options: dict | None = None) -> dict:
    """Compile `fn` for sm_90 (`types`: its pointer and float arguments' Triton types, the rest
    i32; `consts`: its constexprs; `aligned`: arguments known to be multiples of 16) and read its
    resource usage off the cubin (registers, stack and local bytes: a spill needs a stack frame),
    and off its PTX the tensor-core instructions (``mma.sync``, ``wgmma.mma_async``) and 16-byte
    global loads (``ld.global.v4``, ``wide_loads``), and the acquire-release atomics and L2 loads
(``ld.global.cg``) of the attention's ticketed join. ptxas keeps both as they are: the SASS's
    HMMA/HGMMA and LDG.E.128 counts were the same for every variant (2026-11-30), and reading
    the PTX costs nothing where the disassembly took 0.5 s a variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages, **(options or {})})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    fields = dict(x.split(":") for x in next(line for line in out.splitlines() if "REG:" in line).split()
                  if ":" in x and x.split(":")[1].isdigit())
    usage = {"registers": int(fields["REG"]), "stack": int(fields["STACK"]), "local": int(fields["LOCAL"])}
    ptx = kernel.asm["ptx"]
    return {**usage, "tensor_core": ptx.count("mma.sync") + ptx.count("wgmma.mma_async"),
            "wide_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
            "fma": len(re.findall(r"\bfma\.rn\.", ptx)),
            "acq_rel_atomics": len(re.findall(r"\batom\.global\.gpu\.acq_rel\.", ptx)),
            "l2_loads": len(re.findall(r"\bld\.global\.cg\.", ptx))}


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1")
    if sys.argv[1:] == ["--launches"]:
        kinds = [(TILES, report), (GEMV_LAUNCHES, report_gemv), (SKINNY_LAUNCHES, report_skinny)]
    else:
        kinds = [(VARIANTS, report), (INVARIANT, report_invariant), (ROWWISE, report_rowwise), (GEMV, report_gemv),
                 (SKINNY, report_skinny), (SAMPLING, report_sampling)]
    for variants, kind in kinds:
        for v in variants:
            print(json.dumps(kind(*v)), flush=True)
