"""Static performance bound of the decode-attention kernel from its SASS: no GPU needed.

The kernel model (KERNELS): the tensor-core kernel the runtime launches (kernels/decode_attention_tc.cu; the variants
of its cases). It is compiled with NVRTC (kernel_source's options) for sm_90 and sm_80 to a cubin (registers, spills,
occupancy) and disassembled with nvdisasm (PyPI wheel nvidia-cuda-nvdisasm). The variants of the cases below are
compiled again with -lineinfo, which tags every instruction with its inlined source lines (the script checks that the
SASS is otherwise identical), and walked: tools/sass.py says how the walk reads the loops and branches and counts
the instructions one iteration of the token loop issues.

Bound. t_mem = bytes read / copy bandwidth, t_issue = warp-instructions / (SMs x issue rate x clock), t_alu = the
ALU pipe's warp-instructions (ALU_PIPE) / (SMs x ALU rate x clock) (an SM of sm_80 / sm_90 has 16 INT32 lanes a
scheduler, half its issue rate: the walk's ALU share of the instructions matches what Nsight Compute counted, see
docs/findings.md), t_shared = shared-memory wavefronts / (SMs x clock) (an SM's shared memory serves one 128-byte
wavefront a clock; each access counted at its conflict-free minimum: 32 lanes x its width / 128 bytes, one for
narrower ones, an ldmatrix one per 8x8 matrix, a cp.async its shared-memory write; bank conflicts, which depend on
the addresses, are not counted, so this is a lower bound of the shared-memory time); bandwidth fraction <= t_mem /
max(t_mem, t_issue, t_alu, t_shared); speedup over fp16 SDPA <= t_sdpa / max(t_mem, t_issue, t_alu, t_shared) with
t_sdpa = the fp16 cache's bytes / (copy bandwidth x --sdpa-efficiency). Bytes per token are
kvcal.runtime.memory.cache_bytes for a cache that is all quantized body, outliers included; fp16 sinks and
windows, query and output are left out (< 1% of the bytes at 32K tokens). Bytes in flight per SM = global-load
bytes (32 lanes x width) issued per iteration of the side's streaming loop, capped by the cache bytes that
iteration consumes (lanes reading the same word count once), x resident warps. A bound is an upper limit, never
a measurement: every issue slot is assumed usable (no dependency stalls, MUFU and fp64 at full issue rate).

Calibrated prediction. tools/decode_model.py turns a case's counts (warp-instructions and shared wavefronts per
token) into a latency with constants fitted to the newest GPU run of the tensor-core kernel at SHAPE with rows whole
(benchmarks/results/decode_tc_<device>.json), while kernels/ is still the source that run measured (after a change,
the constants of the last fit are kept from bound_decode.json; --walks-from refits them with the walks a bound
written then holds); the tables give it beside every measurement with its error, and for every case on that run's
device in both store layouts: the prediction to write down before a variant is timed. Both of the model's readings
of its constant are fitted and predicted (per token, or per 128-byte line a token's codes touch: lines_per_token),
until a run with each KV head's rows together tells them apart.

Head_dim 256. The tensor-core kernel is walked and bounded again at SHAPE_256 (the benchmark's --head-dim 256, Gemma
3's head size) on sm_90, every case the runtime serves there, with the model fitted at SHAPE's head_dim: a prediction
at a shape it was not fitted on, beside what a GPU measured at 256.

Where a case's counts come from. --lines CASE prints its warp-instructions and shared wavefronts per token by
innermost source line (the kernel's, or the header's it inlines), most first: what a kernel change should aim at,
and what it moved.

Usage: python -m tools.bound_decode [--arch sm_90,sm_80] [--sdpa-efficiency 0.9] [--no-write] [--walks-from COMMIT]
       python -m tools.bound_decode --lines CASE [--lines CASE ...] [--head-dim 256]
Writes benchmarks/results/bound_decode.{json,md} (not with --lines).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import REPO, RESULTS, provenance, write_markdown, write_result
from tools import decode_model
from tools.sass import (ALU_PIPE, CLASSES, GLOBAL_LOADS, Instruction, Walk, WalkError, classify, disassemble, line_profile,
                        load_bytes, nvdisasm, parse_listing, same_code, shared_wavefronts)

# where the written bound is committed: RESULTS may be another folder (a GPU campaign's own, KVCAL_RESULTS_DIR)
COMMITTED_RESULTS = REPO / "benchmarks" / "results"

# H100 SXM: the device the bound is stated for (sm_90); A100 limits give sm_80's occupancy.
H100 = {"sms": 132, "issue_per_clock": 4, "alu_per_clock": 2, "clock_hz": 1.755e9, "copy_bytes_per_s": 3.0e12,
        "latency_s": 700e-9}
LIMITS = {  # per SM: registers, shared memory, warps, blocks; shared memory the driver reserves per block
    "sm_90": {"registers": 65536, "smem": 228 * 1024, "warps": 64, "blocks": 32, "reserved_smem": 1024},
    "sm_80": {"registers": 65536, "smem": 164 * 1024, "warps": 64, "blocks": 32, "reserved_smem": 1024},
}
SHAPE = {"batch": 8, "kv_heads": 8, "group": 4, "head_dim": 128, "tokens": 32768}
SKVQ_GROUPS = 16  # SKVQ's groups of 64 channels over the 8 KV heads' 1024 (kvcal fit-skvq's default group size)

THREADS = 128  # threads per block of the kernel (__launch_bounds__)
LINE_BYTES = 128  # an L2 cache line: its tag is looked up once a request that touches it
KV_HEAD_TOKENS = SHAPE["batch"] * SHAPE["kv_heads"] * SHAPE["tokens"]
# the tensor-core benchmark's second shape (--head-dim 256: Gemma 3's head size), as many KV-head tokens
SHAPE_256 = {**SHAPE, "head_dim": 256}
SLOTS_PER_S = H100["sms"] * H100["issue_per_clock"] * H100["clock_hz"]  # the calibrated model's unit, on either device


@dataclass(frozen=True)
class Case:
    """One row of the bound: a recipe and the kernel variant and runtime layout that serve it."""

    name: str
    key_codec: str
    value_codec: str
    rope: bool
    bits: int  # code width; 0 = fp16
    outliers: float = 0.0  # fraction of elements kept exact (per side)
    note: str = ""
    measured: str = ""  # the tensor-core benchmark's name for the same variant (the measured column, where a GPU ran it)
    group: int = 128  # uniform codes: tokens per key block and channels per value group
    value_bits: int = 0  # the values' code width where it is not the keys' (KVmix's and mixed layers); 0: the keys'

    @property
    def vbits(self) -> int:
        return self.value_bits or self.bits


# ---- What the walk knows about each kernel: update it with the kernel. ----
class TensorCoreKernel:
    """kernels/decode_attention_tc.cu (kvcal.runtime.tensor_core; the runtime's for the bodies it serves): blocks of 4
    warps stream BLOCK_ST tokens an iteration (Variant.stage_tokens: 64, or 128 for the WIDE variants) through
    cp.async pipelines, TPW = BLOCK_ST / 4 of them per warp: packed codes in a pipeline per warp (Variant.private:
    each warp copies and computes its own quarter of the split, behind __syncwarp, rotates its own query for
    pre-RoPE keys every BLOCK_ST tokens and corrects its own outlier tiles of BLOCK_ST tokens), channel groups and
    pre-RoPE keys at head_dim 256 in one of the block (every thread issues its share of the next stage's copies, warp
    w computes its TPW tokens of the stage, behind __syncthreads). So one iteration serves TPW tokens per warp, copies
    included. Steady state: every copy live, a new key block every KG / TPW iterations, and no running maximum growing
    (its rescale is skipped; at 32K tokens a new maximum is rare). The model's shape (SHAPE unless given) sets its
    variants' head_dim and group."""

    source = "decode_attention_tc.cu"
    title = "Tensor-core kernel (kernels/decode_attention_tc.cu, kvcal.runtime.tensor_core: the runtime's for the bodies it serves)"
    token_loop = r"for \(int tile = 0; tile < tiles; \+\+tile\)"
    passes = {"copies": r"// stage `tile` landed for every thread that reads it", "keys": r"// -- key block parameters",
              "softmax": r"// -- online softmax", "values": r"// -- O\^T \+= V\^T P\^T"}
    cases = (
        Case("fp16", "FP16_ONLY", "FP16_ONLY", False, 0, measured="fp16"),
        Case("int2 g128 (KIVI)", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", False, 2, measured="int2-g128"),
        Case("int4 g128 (KIVI)", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", False, 4, measured="int4-g128"),
        Case("int4 g32 (KIVI)", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", False, 4, measured="int4-g32", group=32),
        Case("int2 g64 (KIVI)", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", False, 2, measured="int2-g64", group=64),
        Case("int2 g32 (KIVI's default)", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", False, 2, measured="int2-g32", group=32),
        Case("int2 keys, int4 values, g32 (KVmix's)", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", False, 2, measured="int2k-int4v-g32",
             group=32, value_bits=4),
        Case("int3 keys, int4 values, g32 (KVmix's)", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", False, 3, measured="int3k-int4v-g32",
             group=32, value_bits=4),
        Case("int3 g32 (KIVI-3)", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", False, 3, measured="int3-g32", group=32),
        Case("int2 g128, pre-RoPE keys", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", True, 2, measured="int2-g128-pre-rope"),
        Case("int4 g128, pre-RoPE keys", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", True, 4, measured="int4-g128-pre-rope"),
        Case("nuq3 pre-RoPE, no outliers", "CODEBOOK_CHANNEL", "CODEBOOK_TOKEN", True, 3, measured="nuq3-pre-rope"),
        Case("nuq4 pre-RoPE, no outliers", "CODEBOOK_CHANNEL", "CODEBOOK_TOKEN", True, 4, measured="nuq4-pre-rope"),
        Case("nuq3 keys, nuq4 values, pre-RoPE (mixed's)", "CODEBOOK_CHANNEL", "CODEBOOK_TOKEN", True, 3,
             measured="nuq3k-nuq4v-pre-rope", value_bits=4),
        Case("nuq3 pre-RoPE 1%", "CODEBOOK_CHANNEL", "CODEBOOK_TOKEN", True, 3, 0.01, measured="nuq3-1%-pre-rope"),
        Case("nuq4 pre-RoPE 1%", "CODEBOOK_CHANNEL", "CODEBOOK_TOKEN", True, 4, 0.01, measured="nuq4-1%-pre-rope"),
        Case("nuq2 pre-RoPE 1% (mixed's)", "CODEBOOK_CHANNEL", "CODEBOOK_TOKEN", True, 2, 0.01, measured="nuq2-1%-pre-rope"),
        Case("skvq2 pre-RoPE (SKVQ's)", "PERMUTED_GROUPS", "PERMUTED_GROUPS", True, 2, measured="skvq2-pre-rope",
             note=f"each stage dequantized into fp16 rows first; {SKVQ_GROUPS} channel groups, every one in each head"),
        Case("skvq3 pre-RoPE", "PERMUTED_GROUPS", "PERMUTED_GROUPS", True, 3, measured="skvq3-pre-rope",
             note="as skvq2, its codes in planes3"),
    )

    def __init__(self, shape: dict = SHAPE):
        self.shape = shape

    def _variant(self, case: Case):
        from kvcal.runtime.tensor_core import Variant

        d, gqa = self.shape["head_dim"], self.shape["group"]
        if case.key_codec == "PERMUTED_GROUPS":
            return Variant(d, case.bits, 0, d, gqa, True, channel_groups=1)
        if case.key_codec.startswith("CODEBOOK"):
            return Variant(d, case.bits, 0, d, gqa, case.rope, codebook=True, outliers=case.outliers > 0, value_bits=case.value_bits)
        group = case.group if case.bits else 0
        return Variant(d, case.bits or 16, group, group, gqa, case.rope, value_bits=case.value_bits)

    def tokens_per_iteration(self, case: Case) -> int:
        from kvcal.runtime.tensor_core import WARPS

        return self._variant(case).stage_tokens // WARPS  # tc::Shape::TPW

    def variant(self, case: Case) -> str:
        return self._variant(case).name

    def variants(self) -> list[str]:
        return [self.variant(case) for case in self.served_cases()]

    def served_cases(self) -> list[Case]:
        """The cases whose variant the runtime serves at the shape (at head_dim 256 not the pre-RoPE uniform keys)."""
        from kvcal.runtime import tensor_core

        served = {v.name for v in tensor_core.variants()}
        return [case for case in self.cases if self.variant(case) in served]

    def shared_bytes(self, variant: str, static: int) -> int:
        """Dynamic shared memory (the launcher's), which the ptxas report does not show."""
        return next(self._variant(c).shared_bytes() for c in self.cases if self.variant(c) == variant) + static

    def stages(self, case: Case) -> int:
        return self._variant(case).stages - 1  # cp.async stages in flight while one is computed

    def stage_outliers(self, case: Case) -> float:
        """A side's outliers in an outlier tile (a block's stage): case.outliers of its tokens x D elements."""
        return case.outliers * self._variant(case).stage_tokens * self.shape["head_dim"]

    def outlier_warps(self, case: Case, extra: int = 0) -> list[float]:
        """Per round of a pipeline's pass over a tile side's outliers (each_outlier: member m of the crew, the block's
        128 threads or a private warp's 32 lanes, takes lo + m, lo + m + crew, ...; extra: tasks past them,
        mark_value_runs' end), the fraction of the crew's warps with work in it, on average: warp w has work in round r
        where lo + crew r + 32 w is below hi."""
        from kvcal.runtime.tensor_core import THREADS

        n, crew = self.stage_outliers(case) + extra, 32 if self._variant(case).private else THREADS
        return [min(max(math.ceil((n - crew * r) / 32), 0), crew // 32) / (crew // 32) for r in range(max(1, math.ceil(n / crew)))]

    def channel_turns(self, case: Case) -> float:
        """Expected turns of a warp's value outliers (correct_values: outliers of one channel take turns), its
        stage_outliers / WARPS of them in D channels at random: 1, plus the chance two share a channel, plus (Poisson)
        the chance three do."""
        from kvcal.runtime.tensor_core import WARPS

        k, d = self.stage_outliers(case) / WARPS, self.shape["head_dim"]
        two = 1.0 - math.prod(1.0 - j / d for j in range(1, math.ceil(k)))
        three = 1.0 - math.exp(-math.comb(math.ceil(k), 3) / d**2)
        return 1.0 + two + three

    def inner_loops(self, case: Case) -> list:
        """The outlier passes' loops (the crowded tiles' rounds past the first, the warps' runs of value outliers and
        their channels' turns), channel groups' rounds, head_dim 256's parts of a rotated key; the rest of the tile
        loop unrolls."""
        from kvcal.runtime.tensor_core import THREADS, WARPS

        d = self.shape["head_dim"]
        pairs_per_half = d // 16  # the kernel's HP
        # channel groups: a thread's rounds of 4 tokens of the stage's dequantization (#pragma unroll 1)
        rounds = self._variant(case).stage_tokens // (4 * (THREADS // (d // 4)))
        return [(r"for \(int i = from \+ member \+ CREW; i < to; i \+= CREW\)", sum(self.outlier_warps(case)[1:]), None),
                # mark_value_runs: a round per crew of the outliers and their end
                (r"for \(int i = first \+ member; i <= end; i \+= CREW\)", sum(self.outlier_warps(case, 1)), None),
                # correct_values: a warp's run of its slice's value outliers, 32 at a time, in turns by channel
                (r"for \(int i = value_runs\[slice\] \+ lane;", math.ceil(self.stage_outliers(case) / WARPS / 32), None),
                (r"for \(int r = 0; __ballot_sync", self.channel_turns(case), None),
                (r"for \(int j = 0; j < ST / \(ROUND \* ROW_GROUPS\); \+\+j\)", rounds, None),
                # pre-RoPE keys: a lane's HP = D / 16 pairs of each half in parts of CP = 4 past 8 (#pragma unroll 1)
                (r"for \(int c = 0; c < HP / CP; \+\+c\) rotated_part\(c\);", pairs_per_half // (4 if pairs_per_half > 8 else pairs_per_half), None)]

    def sites(self, case: Case) -> list:
        # pre-RoPE keys: the query's angle exact every 16 rotations (tc::rotate_query); a stage's outliers beyond its
        # copies (OUT_SLOTS = 192 per side; 1% is 82) are read from global memory: never
        return [(r"exact_cos_sin\(p0, __ldg\(inv_freq", 1 / 16),
                (r"if \(i < S::OUT_SLOTS\) return copies\[", 1.0), (r"return __ldg\(out_runs\[side\]\.(positions|values) \+ base \+ i\)", 0.0),
                # outliers' work on M's rows of real heads (g < GQA): lanes of every warp, so every warp runs it
                (r"\*at = int2\{0, 0\};", 1.0), (r"row\[0\] = pack_half2\(p\[0\]\[0\], p\[0\]\[1\]\);", 1.0)]

    def conditions(self, case: Case) -> list:
        return []

    def _last_round_warps(self, case: Case) -> float:
        """Fraction of warps with a copy in the last round of a stage's code copies (a round: one 16-byte chunk per
        thread)."""
        from kvcal.runtime.tensor_core import THREADS, WARPS

        if self._variant(case).private:  # a warp copies its own stage: every round has work for it
            return 1.0
        copies = self._variant(case).stage_tokens * self._variant(case).head_dim * (case.bits or 16) // 8 // 16
        last = copies % THREADS or THREADS
        return math.ceil(last / 32) / WARPS

    def if_bodies(self, case: Case) -> tuple:
        from kvcal.runtime.tensor_core import WARPS

        variant = self._variant(case)
        d, group, stage, tpw = self.shape["head_dim"], case.group, variant.buffer_tokens, self.tokens_per_iteration(case)
        key_param_copies = (1 if group >= stage else stage // group) * 2 * (d * 2 // 16)
        value_param_copies = 2 * max(1, d // group) * stage // 8  # [scale, zero][group] runs of 8-token chunks
        # warps with a copy in a round of a stage's parameter copies: a private pipeline's own warp, else the first ones
        copying = (lambda copies: 1.0) if variant.private else (lambda copies: min(1.0, math.ceil(copies / 32) / WARPS))
        return (
            (r"if \(ahead < tiles\)", 1.0),
            # a private pipeline copies a key block's parameters with the stage that enters it
            (r"if \(!S::PRIVATE \|\| tile == 0 \|\| t0 % S::KB == 0\)", min(1.0, tpw / group)),
            (r"c < PCOPIES\)", copying(key_param_copies)),
            # 3-bit rows are 3 chunks: the last round of a stage's code copies has work for some warps only
            (r"COPIES % COPIERS == 0 \|\| c < COPIES\)", self._last_round_warps(case)),
            (r"const long long offset = live \?", 1.0),
            # value parameters: uniform codes copy 16-byte chunks; codebooks load a token's lo and hi in the pipeline's
            # members 0 .. ST - 1 of the crew (a private pipeline's: half its warp's lanes)
            (r"c < VCOPIES\)", copying(value_param_copies)),
            (r"if \(member < ST\) \{", 1.0 if variant.private else 2 / WARPS),
            (r"if \(vp_row_of < end\)", 1.0),
            (r"if \(token0 < hi\)", 1.0),
            (r"if \(token0 \+ TPW > hi \|\| token0 < lane_visible\)", 0.0),  # masking: a pipeline's last stage, a window's first
            (r"if \(softcap_log2 > 0\.0f\)", 0.0),  # Gemma 2's soft-cap: no case the benchmark times caps
            # a new key block every KG / TPW iterations; codebook keys have one block (per-channel thresholds): never again
            (r"if \(block != key_block\)", 0.0 if variant.codebook or case.key_codec == "PERMUTED_GROUPS" else min(1.0, tpw / group)),
            (r"if \(group_source\[i\] != nullptr\)", min(1.0, SKVQ_GROUPS / 16)),  # the head's groups of its 16 slots
            (r"if \(grew\)", 0.0),
            (r"if \(ROPE && tile \+ 1 < tiles\)", 1.0),
            (r"if \(tile % S::ROTATE_EVERY == 0\)", variant.buffer_tokens / variant.stage_tokens),  # a private warp's own rotation
            # outliers: a tile's first stage copies its outliers (a private warp's every fourth); member 0 writes a
            # tile's ranges; members 0-47 copy a side's chunk each (live chunks: the block's first two warps, a warp's
            # both rounds)
            (r"if \(OUT && tile % S::TILE_STAGES == 0\)", variant.buffer_tokens / variant.stage_tokens),
            (r"if \(tid == 0\) write_ranges", 1 / WARPS),
            (r"if \(member == 0\) write_ranges", 1.0),
            (r"if \(c < 2 \* CHUNKS && chunk \* 8 < \(side \? h\.v_end : h\.k_end\)\)", 1.0 if variant.private else 2 / WARPS),
            (r"if \(tile >= r\.tiles\) return", 0.0),
            # the keys' first round of outliers; a turn of a warp's value outliers has a lane whose turn it is
            (r"if \(from \+ member < to\) patch\(", self.outlier_warps(case)[0]),
            (r"if \(crowded\)", float(len(self.outlier_warps(case)) > 1)),
            (r"if \(mine && turn == r\)", 1.0),
        )


KERNELS = (TensorCoreKernel(),)
# ---- end of the kernel model ----


# ------------------------------------------------------------------------------------------------- compile

def compile_cubin(kernel, arch: str, names: list[str], line_info: bool) -> tuple[bytes, str, dict[str, str]]:
    """Variants `names` of the kernel's source compiled by NVRTC for `arch` with kernel_source's options (and
    -lineinfo when asked): (cubin, ptxas log, name -> mangled name)."""
    from kvcal.errors import KvcalError
    from kvcal.runtime import kernel_source as src

    try:
        compiled = src.nvrtc_compile(src.source(kernel.source), kernel.source, arch, names, ["-lineinfo"] if line_info else [])
    except KvcalError as error:
        raise SystemExit(f"error: {error}") from None
    return compiled.cubin, compiled.log, compiled.lowered


# ------------------------------------------------------------------------------------------------- figures

def occupancy(registers: int, smem: int, arch: str) -> dict:
    """Resident blocks and warps per SM (the CUDA occupancy calculator's rules: registers allocated 8 per thread,
    i.e. in units of 256 per warp; the driver's reserved shared memory per block)."""
    limit, warps_per_block = LIMITS[arch], THREADS // 32
    by = {"registers": limit["registers"] // (math.ceil(registers / 8) * 8 * 32) // warps_per_block,
          "shared memory": limit["smem"] // (smem + limit["reserved_smem"]),
          "warps": limit["warps"] // warps_per_block, "blocks": limit["blocks"]}
    blocks = min(by.values())
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * warps_per_block, "limited_by": min(by, key=by.get)}


def shared_bytes(log: str, mangled: str) -> int:
    """Static shared memory of a function from the ptxas report (absent when it uses none)."""
    m = re.search(rf"Function properties for {re.escape(mangled)}\n(?:.*\n)*?(.*Used \d+ registers.*)", log)
    if not m:
        raise SystemExit(f"error: no ptxas report for {mangled}")
    smem = re.search(r"(\d+) bytes smem", m.group(1))
    return int(smem.group(1)) if smem else 0


def bound(bytes_per_token: float, instructions_per_token: float, sdpa_efficiency: float, wavefronts_per_token: float = 0.0,
          shape: dict = SHAPE, alu_per_token: float = 0.0) -> dict:
    """The bound at `shape` on H100: per KV-head token, all query heads of its group served together; limited_by names
    the resource whose time is the longest (memory, issue, the ALU pipe or shared memory)."""
    tokens = shape["batch"] * shape["kv_heads"] * shape["tokens"]
    issue_rate = H100["sms"] * H100["issue_per_clock"] * H100["clock_hz"]  # warp-instructions per second
    times = {"memory": tokens * bytes_per_token / H100["copy_bytes_per_s"], "issue": tokens * instructions_per_token / issue_rate,
             "ALU pipe": tokens * alu_per_token / (H100["sms"] * H100["alu_per_clock"] * H100["clock_hz"]),
             "shared memory": tokens * wavefronts_per_token / (H100["sms"] * H100["clock_hz"])}
    t_sdpa = tokens * 2 * shape["head_dim"] * 2 / (H100["copy_bytes_per_s"] * sdpa_efficiency)
    limit = max(times, key=times.get)
    return {"budget_per_token": bytes_per_token * issue_rate / H100["copy_bytes_per_s"], "t_mem_us": times["memory"] * 1e6,
            "t_issue_us": times["issue"] * 1e6, "t_alu_us": times["ALU pipe"] * 1e6, "t_shared_us": times["shared memory"] * 1e6,
            "t_sdpa_us": t_sdpa * 1e6,
            "bandwidth_fraction": times["memory"] / times[limit], "speedup_vs_sdpa": t_sdpa / times[limit], "limited_by": limit}


def code_bytes(case: Case, head_dim: int) -> tuple[int, int]:
    """Bytes of one KV head's keys and values of a token: its pieces of the two rows."""
    return head_dim * (case.bits or 16) // 8, head_dim * (case.vbits or 16) // 8


def lines_per_token(pieces: tuple[int, int], kv_heads: int, layout: str) -> float:
    """128-byte lines that a long run of one KV head's tokens touches per token, keys' and values' together (pieces:
    code_bytes). Rows whole, a head's pieces lie a row of kv_heads pieces apart and share their lines with the other
    heads' (one line a token where a piece is 32 to 128 bytes; more where one straddles a line); each KV head's rows
    together (or one KV head), they lie end to end: piece / 128 a token. Averaged over the KV heads, counted over whole
    periods of the pieces' offsets in their lines (the rows start at line boundaries)."""
    heads = kv_heads if layout == "rows" else 1  # the pieces a row holds
    total = 0.0
    for piece in pieces:
        row = piece * heads
        rows = 256 * LINE_BYTES // math.gcd(row, LINE_BYTES)
        touched = sum(len({line for r in range(rows) for line in range((r * row + h * piece) // LINE_BYTES,
                                                                         (r * row + (h + 1) * piece - 1) // LINE_BYTES + 1)})
                      for h in range(heads))
        total += touched / (heads * rows)
    return total


def bytes_per_token(case: Case, shape: dict = SHAPE) -> float:
    """Cache bytes of one KV-head token, K and V: kvcal.runtime.memory's formula for a cache that is all quantized
    body (no fp16 sink, window or residual), outliers included."""
    from kvcal.bundle import LayerRecipe
    from kvcal.runtime.memory import cache_bytes, fp16_bytes

    width, tokens, kv_heads = shape["kv_heads"] * shape["head_dim"], shape["tokens"], shape["kv_heads"]
    if not case.bits:
        total = fp16_bytes(1, width, tokens)
    elif case.key_codec == "PERMUTED_GROUPS":  # SKVQ: fp16 scale and zero per token and group
        recipe = LayerRecipe("skvq", case.bits, case.bits, case.rope, group_size=width // SKVQ_GROUPS)
        total = cache_bytes([recipe], width, tokens, kv_heads=kv_heads)
    else:
        uniform = case.key_codec.startswith("UNIFORM")
        recipe = LayerRecipe("uniform" if uniform else "nuq", case.bits, case.vbits, case.rope,
                             group_size=case.group if uniform else 0, outliers=case.outliers)
        total = cache_bytes([recipe], width, tokens, outliers=round(2 * case.outliers * width * tokens), kv_heads=kv_heads)
    return total / (kv_heads * tokens)


def pass_lines(kernel, source_text) -> list[tuple[int, str]]:
    """(first line, pass) of each pass of the token loop in the kernel's source, found by its pass markers."""
    found = []
    for name, marker in kernel.passes.items():
        lines = [n for n, line in enumerate(source_text(kernel.source), 1) if re.search(marker, line)]
        if len(lines) != 1:
            raise SystemExit(f"error: the marker /{marker}/ of the {name} pass is on {len(lines)} lines of {kernel.source}")
        found.append((lines[0], name))
    return sorted(found)


def analyse(kernel, code: list[Instruction], case: Case, source_text, token_bytes: float, warps_per_sm: int) -> dict:
    """Warp-instructions per KV token by class and by pass, mma.sync (HMMA) per KV token, and bytes in flight per SM,
    from one walk. Plain loads: a streaming loop's iteration is credited at most its share of the side's bytes (half
    the token's: K and V alike here). A cp.async pipeline: the global-load bytes of one token-loop iteration times the
    stages in flight."""
    walk, tile = Walk(code, source_text, case, kernel), kernel.tokens_per_iteration(case)
    count = walk.run()
    starts = pass_lines(kernel, source_text)
    by_class, by_pass, by_opcode = Counter(), Counter(), Counter()
    wavefronts = 0.0
    for ins, n in zip(code, count):
        if n:
            wavefronts += n * shared_wavefronts(ins.opcode) / tile
            outer = ins.lines[-1] if ins.lines else ("", 0)
            name = next((p for first, p in reversed(starts) if outer[0] == kernel.source and outer[1] >= first), starts[0][1])
            by_class[classify(ins.opcode)] += n / tile
            by_pass[name] += n / tile
            by_opcode[ins.opcode.split(".")[0]] += n / tile

    def issued(lo: int, hi: int) -> float:
        return sum(count[i] * load_bytes(code[i].opcode) * 32 for i in range(lo, hi + 1) if code[i].opcode.split(".")[0] in GLOBAL_LOADS)

    in_flight = {}
    if kernel.stages(case) > 1:
        in_flight["pipeline"] = issued(walk.header, walk.end) * kernel.stages(case) * warps_per_sm
    for header, end in sorted(walk.loops.items()):
        side = walk.streams(header)
        if side and count[header] and side not in in_flight:  # the outermost streaming loop that runs
            in_flight[side] = min(issued(header, end), token_bytes / 2 * tile) / count[header] * warps_per_sm
    return {"warp_instructions_per_token": sum(count) / tile, "shared_wavefronts_per_token": wavefronts,
            "alu_per_token": sum(n for op, n in by_opcode.items() if op in ALU_PIPE),
            "by_class": {c: by_class[c] for c in CLASSES}, "by_pass": {p: by_pass[p] for p in kernel.passes},
            "mma_per_token": by_opcode["HMMA"], "top_opcodes": dict(by_opcode.most_common(8)), "in_flight_per_sm": in_flight}


@functools.cache
def source_lines(module: str) -> list[str]:
    """The lines of a kernel source file (kernel_source's reader), which the walk's rules match by line number."""
    from kvcal.runtime import kernel_source as src

    return src.source(module).splitlines()


def walks_with_lines(case_names: list[str], shape: dict = SHAPE):
    """(case, variant, code, each instruction's executions per KV-head token) of each named case at `shape` on sm_90,
    walked; its variant compiled alone with -lineinfo (so its SASS can differ slightly from the module of every
    variant that the bound's tables walk)."""
    kernel = TensorCoreKernel(shape)
    cases = [case for case in kernel.served_cases() if case.name in case_names]
    cubin, _, mangled = compile_cubin(kernel, "sm_90", sorted({kernel.variant(case) for case in cases}), line_info=True)
    functions = parse_listing(disassemble(cubin, line_info=True))
    for case in cases:
        code = functions[mangled[kernel.variant(case)]].code
        try:
            count = Walk(code, source_lines, case, kernel).run()
        except WalkError as e:
            raise SystemExit(f"error: {case.name} on sm_90: {e}") from None
        yield case, kernel.variant(case), code, [n / kernel.tokens_per_iteration(case) for n in count]


def print_line_profiles(case_names: list[str], shape: dict = SHAPE, least: float = 0.05) -> None:
    """Where each named case's warp-instructions and shared wavefronts per KV-head token go on sm_90 at `shape`, by
    innermost source line (lines under `least` of both summed into one row; walks_with_lines)."""
    for case, variant, code, per_token in walks_with_lines(case_names, shape):
        rows = line_profile(code, per_token, 1)
        shown = [row for row in rows if row[1] >= least or row[2] >= least]
        print(f"\n## {case.name} (`{variant}`, sm_90, head_dim {shape['head_dim']}): {sum(r[1] for r in rows):.2f} warp-instructions, "
              f"{sum(r[2] for r in rows):.2f} shared wavefronts per KV-head token\n")
        print("| warp-instr/token | wavefronts/token | line | source |\n|---|---|---|---|")
        for (module, line), instructions, wavefronts in shown:
            text = source_lines(module)[line - 1].strip() if module else "(no line)"
            print(f"| {instructions:.2f} | {wavefronts:.2f} | {Path(module).name}:{line} | `{text[:100]}` |")
        if len(shown) < len(rows):
            rest = [row for row in rows if row not in shown]
            print(f"| {sum(r[1] for r in rest):.2f} | {sum(r[2] for r in rest):.2f} | {len(rest)} other lines | |")


# ------------------------------------------------------------------------------------------------- report

def rounded(x):
    """Floats to 6 significant digits (the figures are estimates; constants keep their value)."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return [rounded(v) for v in x] if isinstance(x, list) else x


def measure(kernel, arch: str, sdpa_efficiency: float, names: list[str] | None = None) -> tuple[list[dict], list[dict]]:
    """(the compile figures of `names`, by default every variant the kernel lists, and the walk of every case it
    serves) of one kernel for one architecture, at the kernel's shape."""
    from kvcal.packing import layout_for
    from kvcal.runtime import kernel_source as src

    names = names or kernel.variants()
    # the compile table as the runtime compiles (no -lineinfo); the walk on the same SASS tagged with source lines
    plain_cubin, log, mangled = compile_cubin(kernel, arch, names, line_info=False)
    plain = parse_listing(disassemble(plain_cubin, line_info=False))
    report = {f.name: f for f in src.parse_ptxas_report(log)}
    compiled = []
    for name in names:
        f = report[mangled[name]]
        smem = kernel.shared_bytes(name, shared_bytes(log, f.name))
        compiled.append({"variant": name, "registers": f.registers, "spill_bytes": f.spill_bytes, "stack_bytes": f.stack_bytes,
                         "smem_bytes": smem, **occupancy(f.registers, smem, arch)})
    by_name = {row["variant"]: row for row in compiled}
    cases = kernel.served_cases()
    variant = {case: kernel.variant(case) for case in cases}
    # the same variants as the compile table's: which others share the module can change a variant's SASS (it did for
    # an int2 g128 variant once head_dim 256 joined)
    cubin, _, tagged_names = compile_cubin(kernel, arch, names, line_info=True)
    tagged = parse_listing(disassemble(cubin, line_info=True))
    walks = []
    for case in cases:
        function = tagged[tagged_names[variant[case]]]
        if not same_code(function, plain[mangled[variant[case]]]):
            raise SystemExit(f"error: -lineinfo changed the {arch} SASS of {variant[case]}; the walk would not be of the compiled code")
        row = by_name[variant[case]]
        token_bytes = bytes_per_token(case, kernel.shape)
        try:
            walk = analyse(kernel, function.code, case, source_lines, token_bytes, row["warps_per_sm"])
        except WalkError as e:
            raise SystemExit(f"error: {case.name} on {arch}: {e}") from None
        layout = f"{layout_for(case.bits)} {case.bits}-bit" if case.bits else "fp16"
        if case.value_bits:
            layout += f", values {layout_for(case.value_bits)} {case.value_bits}-bit"
        walks.append({"case": case.name, "variant": variant[case], "layout": layout,
                      "note": case.note, "bytes_per_token": token_bytes, "code_bytes": code_bytes(case, kernel.shape["head_dim"]),
                      "registers": row["registers"],
                      "blocks_per_sm": row["blocks_per_sm"], "warps_per_sm": row["warps_per_sm"], **walk,
                      "bound": bound(token_bytes, walk["warp_instructions_per_token"], sdpa_efficiency,
                                     walk["shared_wavefronts_per_token"], kernel.shape, walk["alu_per_token"])})
    return compiled, walks


def tool_versions() -> dict:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    out = subprocess.run([str(nvdisasm()), "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release ([\d.]+)", out)
    return {"nvrtc": f"{major}.{minor}", "nvdisasm": release.group(1) if release else "unknown"}


def markdown(result: dict) -> list[str]:
    h, s, sdpa = result["h100"], result["shape"], result["sdpa_efficiency"]
    lines = [
        "# Static bound of decode attention (no GPU)",
        "",
        f"`python -m tools.bound_decode` at commit {result['commit']}, {result['date']}; NVRTC {result['tools']['nvrtc']}, "
        f"nvdisasm {result['tools']['nvdisasm']}. Bound for H100 SXM from the sm_90 SASS: {h['sms']} SMs, {h['issue_per_clock']} "
        f"warp-instructions issued per clock per SM, {h['clock_hz'] / 1e9} GHz, {h['copy_bytes_per_s'] / 1e12} TB/s copy "
        f"bandwidth. Shape: B={s['batch']}, {s['kv_heads']} KV heads, GQA {s['group']} ({s['kv_heads'] * s['group']} query heads), "
        f"D={s['head_dim']}, L={s['tokens']}. fp16 SDPA reads 2*D*2 bytes per token per KV head at {sdpa:.0%} of copy "
        "bandwidth (assumed: the FlashAttention/FlashDecoding fp16 decode kernels that torch SDPA dispatches to stream K/V "
        "near the copy rate at long context).",
        "",
        "Per KV-head token (all query heads of its group served by one read). budget = warp-instructions per token that keep "
        "pace with HBM. Bandwidth bound = t_mem / max(t_mem, t_issue, t_alu, t_shared); speedup bound = t_sdpa / max(t_mem, "
        "t_issue, t_alu, t_shared), with t_alu = the ALU pipe's warp-instructions (bit manipulation and logic, integer add, "
        f"compare and select, fp32 compare, min / max and select, fp32 -> fp16 packing; not IMAD) / (SMs x {h['alu_per_clock']} "
        "x clock): half the issue rate, so the ALU pipe fills before issue where those are more than half the instructions; "
        "t_shared = shared-memory wavefronts / (SMs x clock) counted conflict-free (each access at "
        "its width's minimum; bank conflicts are not counted: a lower bound of the shared-memory time); limited by: the "
        "longest of the four. mma/token: mma.sync instructions (HMMA) per token, the tensor pipe's work, which neither the "
        "bound nor the calibrated model weighs. In flight: plain loads, the global-load bytes of one iteration of a side's streaming "
        "loop x resident warps (keys / values); a cp.async pipeline, the global-load bytes of one token-loop iteration "
        "x the stages in flight x resident warps. "
        f"{h['copy_bytes_per_s'] * h['latency_s'] / h['sms'] / 1024:.1f} KiB per SM covers {h['latency_s'] * 1e9:.0f} ns of HBM "
        "latency at this bandwidth (Little's law). A bound is an upper limit, never a measurement: it assumes every issue "
        "slot is used (no dependency stalls; MUFU and fp64 at the full issue rate).",
        "",
        "Bytes/token: kvcal.runtime.memory.cache_bytes for a cache that is all quantized body (fp16 sinks, windows and "
        "KIVI's residual, < 1% of the bytes at 32K tokens, left out). Uniform (KIVI): packed codes + fp16 scale and zero per "
        "group of 128 channels per token (values) and per channel per block of 128 tokens (keys). nuq (KVQuant): packed codes "
        "(3-bit: bit-planes 2 + 1, exactly 3 bits per code), fp16 lo/hi per token for values, 1% outliers per side at 4 B "
        "each (uint16 position in its tile, fp16 value) plus an int32 offset per KV head and tile of 64 tokens; per-channel key thresholds and codebooks are calibration constants, not cache bytes. "
        f"SKVQ: packed codes + fp16 scale and zero per token and channel group ({SKVQ_GROUPS} groups over the KV width); its "
        "permutation is a calibration constant.",
    ]
    for kernel in KERNELS:
        lines += kernel_section(result, kernel)
    if "sm_90_d256" in result:
        lines += head_dim_256_section(result)
    return lines


def head_dim_256_section(result: dict) -> list[str]:
    """The tensor-core kernel at SHAPE_256: its walk and bound, the calibrated model's prediction (fitted at SHAPE's
    head_dim) on the fitting run's device, and what a GPU measured at that head_dim."""
    kernel = TensorCoreKernel(SHAPE_256)
    cases = result["sm_90_d256"][kernel.source]["cases"]
    calibration = result.get("calibration", {}).get(kernel.source)
    on = f" on {calibration['device']}" if calibration else ""
    lines = ["", "## The tensor-core kernel at head_dim 256", "",
             f"The tensor-core benchmark's --head-dim 256 (Gemma 3's head size; B={SHAPE_256['batch']}, {SHAPE_256['kv_heads']} "
             f"KV heads, GQA {SHAPE_256['group']}, L={SHAPE_256['tokens']}): the cases the runtime serves there (not the pre-RoPE "
             "uniform keys), walked on the sm_90 SASS compiled at 256, bounded as above. The prediction is the calibrated "
             "model fitted at head_dim 128 (above): a shape it was not fitted on, which the GPU campaign's kernels-d256 "
             "stage measures.", "",
             "| variant | kernel variant | bytes/token | warp-instr/token | of them ALU pipe | shared wavefronts/token "
             f"| registers | blocks/SM | bandwidth bound | limited by | speedup vs fp16 SDPA, at best | {prediction_columns(on)} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in cases:
        b = w["bound"]
        predicted = " | ".join(predictions(w, calibration)) if calibration is not None else "- | - | -"
        lines.append(f"| {w['case']} | `{w['variant']}` | {w['bytes_per_token']:.1f} | {w['warp_instructions_per_token']:.1f} "
                     f"| {w['alu_per_token']:.1f} | {w['shared_wavefronts_per_token']:.1f} | {w['registers']} | {w['blocks_per_sm']} "
                     f"| {b['bandwidth_fraction']:.1%} | {b['limited_by']} | {b['speedup_vs_sdpa']:.2f}x | {predicted} |")
    return lines + measured_table(cases, kernel, measured_on_gpus(head_dim=SHAPE_256["head_dim"]), calibration)


def measured_on_gpus(results: Path = RESULTS, head_dim: int = SHAPE["head_dim"]) -> list[dict]:
    """Per decode_tc_<device>*.json that the tensor-core benchmark wrote on a GPU at head_dim: its device, commit,
    date, copy bandwidth, KV heads, KV-head tokens, store layout (a name of kvcal.runtime.store.STORE_LAYOUTS:
    `benchmarks.kernels gpu --layout`), and per variant the fastest row at SHAPE's batch and length (the split plans
    it timed differ only in the split size)."""
    runs = []
    for path in sorted(results.glob("decode_tc_*.json")):
        run = json.loads(path.read_text())
        if run.get("head_dim", 128) != head_dim:
            continue
        fastest = {}
        for row in run["results"]:
            if row["batch"] == SHAPE["batch"] and row["tokens"] == SHAPE["tokens"]:
                best = fastest.get(row["variant"])
                fastest[row["variant"]] = row if best is None or row["latency_us"] < best["latency_us"] else best
        runs.append({"device": run["device"], "commit": run["commit"], "date": run["date"],
                     "copy_bytes_per_s": run["copy_bandwidth_gbps"] * 1e9, "kv_heads": run["kv_heads"],
                     "layout": run.get("layout", "rows"), "kv_head_tokens": SHAPE["batch"] * run["kv_heads"] * SHAPE["tokens"],
                     "variants": fastest})
    return runs


def predicted_us(walk: dict, calibration: dict, copy_bytes_per_s: float, bytes_read: float | None = None,
                 kv_head_tokens: int = KV_HEAD_TOKENS, reading: str = "token", kv_heads: int = SHAPE["kv_heads"],
                 layout: str = "rows") -> float:
    """The calibrated model's latency of a case over kv_head_tokens (SHAPE's unless given) of kv_heads KV heads kept in
    `layout` on a device of that copy bandwidth (bytes_read: a measured row's, else the case's bytes per token), its
    constant paid as `reading` says (decode_model.READINGS)."""
    fitted = calibration[reading]
    model = decode_model.Model(fitted["per_instruction"], fitted["constant"], reading)
    total = walk["bytes_per_token"] * kv_head_tokens if bytes_read is None else bytes_read
    return 1e6 * decode_model.predicted_seconds(model, walk["warp_instructions_per_token"], walk["shared_wavefronts_per_token"],
                                                total, copy_bytes_per_s, kv_head_tokens, SLOTS_PER_S,
                                                lines_per_token(walk["code_bytes"], kv_heads, layout))


def prediction_columns(on: str = "") -> str:
    """The header of the calibrated predictions the tables give per case (`predictions`), on a device named by `on`."""
    return f"predicted{on}, per token (either layout) | per line, rows whole | per line, each KV head's rows together"


def predictions(walk: dict, calibration: dict) -> list[str]:
    """prediction_columns' cells for a case at SHAPE's KV-head tokens on the fitting run's device: each latency and
    its fraction of copy bandwidth."""
    copy = calibration["copy_bytes_per_s"]
    cells = []
    for reading, layout in (("token", "rows"), ("line", "rows"), ("line", "heads")):
        us = predicted_us(walk, calibration, copy, reading=reading, layout=layout)
        cells.append(f"{us:.1f} us ({walk['bytes_per_token'] * KV_HEAD_TOKENS / copy * 1e6 / us:.0%})")
    return cells


def kernels_same(commit: str, other: str | None = None) -> bool:
    """Whether kernels/ is the same at commit and at other (None: the working tree); False where git does not know
    a commit."""
    compared = [commit] + ([other] if other else [])
    return subprocess.run(["git", "diff", "--quiet", *compared, "--", "kernels/"], cwd=REPO, capture_output=True).returncode == 0


def calibrate(cases: list[dict], kernel, runs: list[dict], previous: dict | None = None,
              same_kernels=kernels_same, walked_at: str = "") -> dict | None:
    """tools.decode_model fitted in both readings to the newest run with rows whole that measured the kernel's cases
    (the walks `cases`, of the SASS at commit walked_at), with each fitted case's error in the fit and left out of it. Only the SASS that run measured
    can be fitted to it: where same_kernels(its commit) says kernels/ is not what the walks walked, the previous
    calibration (fitted when it was the same) is kept, and the walk's counts of the changed code are predicted with it.
    None where no run measured three cases off the memory roofline and none was fitted before."""
    names = {c.name: c.measured for c in kernel.cases}
    by_name = {c.name: c for c in kernel.cases}
    # (a run with each KV head's rows together is what tells the readings apart: compared, not fitted)
    measured = [run for run in runs if run["layout"] == "rows" and any(names.get(w["case"]) in run["variants"] for w in cases)]
    if not measured:
        return previous
    run = max(measured, key=lambda r: r["date"])
    if not same_kernels(run["commit"]):
        return previous
    points = []
    for w in cases:
        row = run["variants"].get(names.get(w["case"]))
        if row is not None and row["fraction_of_copy_bandwidth"] < decode_model.MEMORY_BOUND:
            slots = decode_model.measured_slots(row["latency_us"] * 1e-6, run["kv_head_tokens"], SLOTS_PER_S)
            lines = lines_per_token(code_bytes(by_name[w["case"]], kernel.shape["head_dim"]), run["kv_heads"], "rows")
            points.append(decode_model.Point(w["case"], w["warp_instructions_per_token"], w["shared_wavefronts_per_token"],
                                             slots, lines))
    if len(points) < 3:
        return previous
    fits = {}
    for reading in decode_model.READINGS:
        model = decode_model.fit(points, reading)
        fits[reading] = {"per_instruction": model.per_instruction, "constant": model.constant,
                         "fit_error": {p.name: decode_model.relative_error(model, p) for p in points},
                         "leave_one_out": decode_model.leave_one_out(points, reading)}
    return {"device": run["device"], "commit": run["commit"], "date": run["date"], "copy_bytes_per_s": run["copy_bytes_per_s"],
            "walked_at": walked_at, **fits}


def measured_table(cases: list[dict], kernel, runs: list[dict], calibration: dict | None = None) -> list[str]:
    """The bound, and the calibrated prediction where there is one, beside what a GPU measured for the same variants
    (none where no run has them)."""
    names = {c.name: c.measured for c in kernel.cases}
    rows = [(w, run, run["variants"][names[w["case"]]]) for run in runs for w in cases
            if names.get(w["case"]) in run["variants"]]
    if not rows:
        return []
    lines = ["", "The bound beside a measurement (benchmarks/kernels/tensor_core.py on a GPU, same shape, L2 flushed: the fastest "
             "of the split plans it timed; its results file names how it ran). The gap is what the bound does not model: "
             "stalls that leave issue slots empty, shared-memory bank conflicts, and units other than issue, the ALU pipe and "
             "shared memory that fill first (benchmarks/kernels/ncu.py counts them with Nsight Compute: the H100's int2 and "
             "int4 g128 issued in about half their slots with about one warp eligible per scheduler and no unit saturated, "
             "while the codebook variants were held by shared-memory wavefronts, their table lookups' bank conflicts among "
             "them). predicted: the calibrated model below on the run's device (its copy bandwidth, the run's bytes, KV heads "
             "and store layout), its constant paid per token / per line; error: predicted over measured latency. A run at "
             "another commit than the walked SASS measured other code.", "",
             "| variant | bandwidth bound | predicted, of copy bandwidth (per token / per line) | measured | speedup bound "
             "| predicted speedup vs fp16 SDPA (per token / per line) | measured | error (per token / per line) | run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for w, run, row in rows:
        b = w["bound"]
        heads = "" if run["kv_heads"] == SHAPE["kv_heads"] else f", {run['kv_heads']} KV head{'s' * (run['kv_heads'] > 1)}"
        heads += ", each KV head's rows together" if run["layout"] == "heads" else ""
        fraction = speedup = error = "-"
        if calibration is not None:
            us = [predicted_us(w, calibration, run["copy_bytes_per_s"], row["bytes_read"], run["kv_head_tokens"], reading,
                               run["kv_heads"], run["layout"]) for reading in decode_model.READINGS]
            fraction = " / ".join(f"{row['bytes_read'] / run['copy_bytes_per_s'] * 1e6 / u:.1%}" for u in us)
            speedup = " / ".join(f"{row['sdpa_fp16_latency_us'] / u:.2f}x" for u in us)
            error = " / ".join(f"{u / row['latency_us'] - 1:+.0%}" for u in us)
        lines.append(f"| {w['case']} | {b['bandwidth_fraction']:.1%} | {fraction} | {row['fraction_of_copy_bandwidth']:.1%} "
                     f"| {b['speedup_vs_sdpa']:.2f}x | {speedup} | {row['speedup_vs_sdpa_fp16']:.2f}x | {error} "
                     f"| {run['device']}, {run['commit']}, {run['date']}{heads} |")
    return lines


def committed_predictions(results: Path = COMMITTED_RESULTS, shape: dict = SHAPE) -> dict | None:
    """What the written bound (bound_decode.json) predicts for the tensor-core benchmark's variants at `shape` (SHAPE
    or SHAPE_256 at any number of KV heads: a walk counts per KV-head token): its commit, its calibration, and per
    benchmark variant name the case's walk (predicted_us gives the latency on a device over the shape's KV-head
    tokens); None before a calibration was written, or for a shape it did not walk."""
    written = results / "bound_decode.json"
    if not written.exists():
        return None
    bound = json.loads(written.read_text())
    kernel = TensorCoreKernel()
    calibration = bound.get("calibration", {}).get(kernel.source)
    key = next((key for walked, key in ((SHAPE, "sm_90"), (SHAPE_256, "sm_90_d256"))
                if {**shape, "kv_heads": walked["kv_heads"]} == walked), "")
    walked = bound.get(key, {})
    if calibration is None or kernel.source not in walked:
        return None
    names = {c.name: c.measured for c in kernel.cases if c.measured}
    walks = {names[w["case"]]: w for w in walked[kernel.source]["cases"] if w["case"] in names}
    return {"commit": bound["commit"], "calibration": calibration, "walks": walks}


def calibration_section(cases: list[dict], calibration: dict) -> list[str]:
    """The fitted constants of both readings, each fitted case's errors, and every case's predictions on the fitting
    run's device in both store layouts."""
    from kvcal.runtime.store import STORE_LAYOUTS

    c, token, line = calibration, calibration["token"], calibration["line"]

    def rms(errors: dict) -> str:
        return f"{math.sqrt(sum(e * e for e in errors.values()) / len(errors)):.1%}"

    lines = ["", f"Calibrated model (tools/decode_model.py), fitted to {c['device']} at {c['commit']}, {c['date']} (rows whole, "
             f"{SHAPE['kv_heads']} KV heads; the walks of the SASS at {c['walked_at']}): per KV-head token max(memory time, slots), in issue slots of {H100['sms']} SMs x "
             f"{H100['issue_per_clock']} schedulers at {H100['clock_hz'] / 1e9} GHz (the same unit for either device), its "
             "constant read two ways and fitted alike, on the run's variants under "
             f"{decode_model.MEMORY_BOUND:.0%} of copy bandwidth:", "",
             f"- per token: slots = {token['per_instruction']:.3f} x warp-instructions + "
             f"{decode_model.SLOTS_PER_WAVEFRONT:.0f} x shared wavefronts + {token['constant']:.1f} (rms error "
             f"{rms(token['fit_error'])} in the fit, {rms(token['leave_one_out'])} left out);",
             f"- per line: slots = {line['per_instruction']:.3f} x warp-instructions + "
             f"{decode_model.SLOTS_PER_WAVEFRONT:.0f} x shared wavefronts + {line['constant']:.1f} x the 128-byte lines a "
             f"token's codes touch (rms error {rms(line['fit_error'])} in the fit, {rms(line['leave_one_out'])} left out).", "",
             "Rows whole, every fitted variant's codes touch about 2 lines a token (nuq3's 48-byte pieces 2.5), so the two "
             "readings predict the fitted layout alike; each KV head's rows together, a token's codes touch bytes / 128 lines "
             "(int2 g128: 0.5 where rows whole take 2), and the per-line reading charges that fraction of its constant. Error in the fit and left out of it "
             "(the variant predicted from the others), per token / per line, then every case's predictions on that device "
             "(its copy bandwidth, the case's bytes), latency and fraction of copy bandwidth:", "",
             f"| variant | error in the fit | left out | lines a token, rows whole / heads together | {prediction_columns()} |",
             "|---|---|---|---|---|---|---|"]
    for w in cases:
        fitted = (" | ".join(f"{token[key][w['case']]:+.0%} / {line[key][w['case']]:+.0%}" for key in ("fit_error", "leave_one_out"))
                  if w["case"] in token["fit_error"] else "- | -")
        counted = " / ".join(f"{lines_per_token(w['code_bytes'], SHAPE['kv_heads'], layout):.2f}" for layout in STORE_LAYOUTS)
        lines.append(f"| {w['case']} | {fitted} | {counted} | {' | '.join(predictions(w, c))} |")
    return lines


def written_bound(commit: str) -> dict | None:
    """The bound_decode.json committed at `commit`; None where git has none there."""
    shown = subprocess.run(["git", "show", f"{commit}:benchmarks/results/bound_decode.json"], cwd=REPO, capture_output=True, text=True)
    return None if shown.returncode else json.loads(shown.stdout)


def kernel_section(result: dict, kernel) -> list[str]:
    cases = result["sm_90"][kernel.source]["cases"]
    passes = " + ".join(kernel.passes)
    lines = ["", f"## {kernel.title}", "", (kernel.__doc__ or "").replace("\n    ", " ").strip(), "",
             f"| variant | kernel variant, runtime layout | bytes/token | warp-instr/token ({passes}) | of them ALU pipe | budget "
             "| shared wavefronts/token | mma/token | registers | blocks/SM | warps/SM "
             "| in flight/SM (B) | bandwidth bound | limited by | speedup vs fp16 SDPA, at best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in cases:
        p, b = w["by_pass"], w["bound"]
        flight = ", ".join(f"{side} {n:.0f}" for side, n in w["in_flight_per_sm"].items()) or "-"
        lines.append(f"| {w['case']} | `{w['variant']}`, {w['layout']} | {w['bytes_per_token']:.1f} | {w['warp_instructions_per_token']:.0f} "
                     f"({' + '.join(f'{p[name]:.0f}' for name in kernel.passes)}) | {w['alu_per_token']:.1f} | {b['budget_per_token']:.1f} "
                     f"| {w['shared_wavefronts_per_token']:.1f} | {w['mma_per_token']:.2f} | {w['registers']} "
                     f"| {w['blocks_per_sm']} | {w['warps_per_sm']} | {flight} | {b['bandwidth_fraction']:.1%} | {b['limited_by']} "
                     f"| {b['speedup_vs_sdpa']:.2f}x |")
    calibration = result.get("calibration", {}).get(kernel.source)
    lines += measured_table(cases, kernel, measured_on_gpus(), calibration)
    if calibration is not None:
        lines += calibration_section(cases, calibration)
    lines += ["", "Warp-instructions per KV token by class (sm_90; sm_80's total for comparison). fp32 includes MUFU; "
              "int/logic includes moves and predicates; conversion includes fp16 -> fp32 (HADD2.F32); other: fp64 (RoPE angle "
              "reduction), fp16x2, MMA, shuffles, stores.", "",
              "| variant | " + " | ".join(CLASSES) + " | total sm_90 | total sm_80 | top opcodes (sm_90) |",
              "|---|" + "---|" * (len(CLASSES) + 3)]
    sm80 = {w["case"]: w for w in result.get("sm_80", {}).get(kernel.source, {}).get("cases", [])}
    for w in cases:
        other = sm80.get(w["case"])
        top = ", ".join(f"{k} {v:.0f}" for k, v in list(w["top_opcodes"].items())[:5])
        total80 = f"{other['warp_instructions_per_token']:.1f}" if other else "-"
        lines.append(f"| {w['case']} | " + " | ".join(f"{w['by_class'][c]:.1f}" for c in CLASSES)
                     + f" | {w['warp_instructions_per_token']:.1f} | {total80} | {top} |")
    notes = " ".join(f"{w['case']}: {w['note']}." for w in cases if w["note"])
    lines += (["", "Notes: " + notes] if notes else []) + [
        "", f"Variants compiled (as the runtime compiles them; occupancy from registers, shared memory + 1 KiB reserved per "
        f"block, {THREADS} threads per block; H100 limits for sm_90, A100 for sm_80):", "",
        "| variant | arch | registers | spill bytes | stack bytes | shared bytes | blocks/SM | warps/SM | limited by |",
        "|---|---|---|---|---|---|---|---|---|"]
    for arch in ("sm_90", "sm_80"):
        for row in result.get(arch, {}).get(kernel.source, {}).get("compiled", []):
            lines.append(f"| `{row['variant']}` | {arch} | {row['registers']} | {row['spill_bytes']} | {row['stack_bytes']} "
                         f"| {row['smem_bytes']} | {row['blocks_per_sm']} | {row['warps_per_sm']} | {row['limited_by']} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    from kvcal.runtime import kernel_source as src

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90,sm_80",
                        help="comma-separated architectures to compile and walk; sm_90 is required (the bound is for H100)")
    parser.add_argument("--sdpa-efficiency", type=float, default=0.9,
                        help="fraction of copy bandwidth the fp16 SDPA reference reaches (default 0.9)")
    parser.add_argument("--no-write", action="store_true", help="print the tables without writing benchmarks/results/")
    parser.add_argument("--lines", action="append", default=[], metavar="CASE",
                        help="only print where CASE's warp-instructions and shared wavefronts per token go, by innermost "
                             "source line (sm_90; nothing written); repeatable, a case as the bound's tables name it")
    parser.add_argument("--head-dim", type=int, choices=(SHAPE["head_dim"], SHAPE_256["head_dim"]), default=SHAPE["head_dim"],
                        help="with --lines: the shape whose variants to compile (default %(default)s)")
    parser.add_argument("--walks-from", metavar="COMMIT",
                        help="fit the calibration with the walks of the bound written at COMMIT (its kernels/ must be what "
                             "the newest GPU run measured): to refit after kernels/ changed since that run")
    args = parser.parse_args(argv)
    if args.lines:
        shape = SHAPE if args.head_dim == SHAPE["head_dim"] else SHAPE_256
        known = [case.name for case in TensorCoreKernel(shape).served_cases()]
        if unknown := [name for name in args.lines if name not in known]:
            parser.error(f"--lines {unknown[0]!r}: no such case at head_dim {args.head_dim}; the cases: {', '.join(known)}")
        nvdisasm()
        print_line_profiles(args.lines, shape)
        return
    if args.head_dim != SHAPE["head_dim"]:
        parser.error("--head-dim goes with --lines (the tables walk both shapes)")
    older = written_bound(args.walks_from) if args.walks_from else None
    if args.walks_from and older is None:
        parser.error(f"--walks-from {args.walks_from}: git has no benchmarks/results/bound_decode.json at that commit")
    archs = args.arch.split(",")
    if "sm_90" not in archs or not set(archs) <= set(src.ARCHITECTURES):
        parser.error(f"--arch must list sm_90 and only {', '.join(src.ARCHITECTURES)}; got {args.arch!r}")
    if not 0 < args.sdpa_efficiency <= 1:
        parser.error(f"--sdpa-efficiency must be in (0, 1]; got {args.sdpa_efficiency}")
    nvdisasm()  # fail before compiling when it is missing
    started = provenance()
    result = {"tools": tool_versions(), "h100": H100, "limits": LIMITS, "shape": SHAPE, "sdpa_efficiency": args.sdpa_efficiency}
    def walked(kernel, arch: str) -> dict:
        compiled, walks = measure(kernel, arch, args.sdpa_efficiency)
        return {"compiled": compiled, "cases": walks}

    for arch in sorted(archs, reverse=True):
        result[arch] = {kernel.source: walked(kernel, arch) for kernel in KERNELS}
    # the tensor-core kernel at its benchmark's second shape, sm_90 (the bound's architecture)
    wide = TensorCoreKernel(SHAPE_256)
    result["sm_90_d256"] = {wide.source: walked(wide, "sm_90")}
    runs = measured_on_gpus()
    written = RESULTS / "bound_decode.json"
    previous = json.loads(written.read_text()).get("calibration", {}) if written.exists() else {}
    fitted_walks, same_kernels, walked_at = result["sm_90"], kernels_same, started["commit"]
    if older is not None:
        fitted_walks, same_kernels, walked_at = older["sm_90"], functools.partial(kernels_same, older["commit"]), older["commit"]
    result["calibration"] = {kernel.source: fitted for kernel in KERNELS
                             if (fitted := calibrate(fitted_walks[kernel.source]["cases"], kernel, runs,
                                                     previous.get(kernel.source), same_kernels, walked_at)) is not None}
    result = rounded(result)
    lines = markdown({**started, **result})
    if args.no_write:
        print("\n".join(lines))
        return
    write_result("bound_decode", result, started)
    write_markdown("bound_decode", lines)


if __name__ == "__main__":
    main()
