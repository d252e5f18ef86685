"""tools/bound_decode.py: what the bound makes of the walk's counts (classes, passes, bytes in flight), occupancy,
the bound arithmetic and the calibrated predictions on hand-written input; every case of the kernel model walked on
today's SASS."""

import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.nvrtc

from helpers.sass_listing import LISTING, SOURCE, ToyKernel
from tools import bound_decode as bd
from tools import decode_model as dm
from tools import sass

CASE = bd.Case("int2 g128", "UNIFORM_CHANNEL", "UNIFORM_TOKEN", False, 2)


@pytest.fixture
def model():
    return ToyKernel()


def test_analyse_classes_passes_and_bytes_in_flight(model):
    code = sass.parse_listing(LISTING)["kern"].code
    result = bd.analyse(model, code, CASE, SOURCE.__getitem__, token_bytes=1000.0, warps_per_sm=8)
    assert result["warp_instructions_per_token"] == 14.0 / 4
    assert result["by_pass"] == {"keys": 5.75 / 4, "softmax": 2 / 4, "values": 6.25 / 4}  # by the outermost line
    assert result["by_class"]["loads"] == (1 + 3) / 4 and result["by_class"]["conversion"] == 0.25 / 4
    assert result["alu_per_token"] == 1 / 4  # the ISETP; the MOV before the loop never runs in it
    # the inner loop issues one 2-byte load per lane per iteration: 64 B, under its share of the token's bytes
    assert result["in_flight_per_sm"] == {"values": 64 * 8}


def test_lines_prints_a_cases_profile_by_source_line(capsys):
    bd.main(["--lines", "int2 g128 (KIVI)"])
    out = capsys.readouterr().out
    assert "## int2 g128 (KIVI) (`decode_tc<128, 2, 128, 128, 4, false, false, false>`, sm_90, head_dim 128)" in out
    assert " intrinsics.cuh:" in out and "lop3.b32" in out  # the converters' lines, read from the included header
    bd.main(["--lines", "nuq3 pre-RoPE 1%", "--head-dim", "256"])
    assert "(`decode_tc<256, 3, 0, 256, 4, true, true, true>`, sm_90, head_dim 256)" in capsys.readouterr().out
    for argv, message in ((["--lines", "int9"], "'int9': no such case at head_dim 128"),
                          (["--lines", "int2 g128, pre-RoPE keys", "--head-dim", "256"], "no such case at head_dim 256"),
                          (["--head-dim", "256"], "--head-dim goes with --lines")):
        with pytest.raises(SystemExit) as error:
            bd.main(argv)
        assert error.value.code == 2 and message in capsys.readouterr().err


def test_bound_arithmetic():
    issue = 132 * 4 * 1.755e9  # warp-instructions per second on H100
    b = bd.bound(72.0, 526.0, 0.9)
    assert math.isclose(b["budget_per_token"], 72 * issue / 3e12)
    assert math.isclose(b["bandwidth_fraction"], 72 * issue / 3e12 / 526)
    assert math.isclose(b["speedup_vs_sdpa"], (512 / (0.9 * 3e12)) / (526 / issue))
    assert b["limited_by"] == "issue"
    fast = bd.bound(72.0, 10.0, 0.9)  # memory-bound: the whole bandwidth, 512 / 72 bytes fewer than fp16 at 90%
    assert fast["bandwidth_fraction"] == 1.0 and math.isclose(fast["speedup_vs_sdpa"], 512 / 72 / 0.9)
    assert fast["limited_by"] == "memory"
    # shared memory: one wavefront a clock per SM, so 40 a token take 4 x the time of 40 warp-instructions
    shared = bd.bound(72.0, 40.0, 0.9, wavefronts_per_token=40.0)
    assert shared["limited_by"] == "shared memory"
    assert math.isclose(shared["bandwidth_fraction"], 72 * issue / 4 / 3e12 / 40)
    # the ALU pipe retires half the issue rate: 30 of 40 instructions there take the time of 60 issued
    alu = bd.bound(72.0, 40.0, 0.9, alu_per_token=30.0)
    assert alu["limited_by"] == "ALU pipe" and math.isclose(alu["bandwidth_fraction"], 72 * issue / 3e12 / 60)
    assert bd.bound(72.0, 40.0, 0.9, alu_per_token=19.0)["limited_by"] == "issue"  # fewer than half of them


def test_measurements_sit_beside_the_bound_of_the_same_variant(tmp_path):
    """measured_on_gpus keeps the fastest row per variant at the bound's shape (not another head_dim's run);
    measured_table pairs it with the bound of the case that names it, and gives nothing where no run has the case's
    variant; a run at other KV heads is named so and predicted over its own KV-head tokens, and one with each KV
    head's rows together is named so beside the same per-token prediction and a per-line one of its fewer lines."""
    import json

    shape = {"batch": bd.SHAPE["batch"], "tokens": bd.SHAPE["tokens"], "bytes_read": 151257088, "sdpa_fp16_latency_us": 255.7}
    rows = [{"variant": "int2-g128", "latency_us": 141.0, "fraction_of_copy_bandwidth": 0.36, "speedup_vs_sdpa_fp16": 2.6, **shape},
            {"variant": "int2-g128", "latency_us": 126.0, "fraction_of_copy_bandwidth": 0.40, "speedup_vs_sdpa_fp16": 2.9, **shape},
            {"variant": "int2-g128", "latency_us": 50.0, "fraction_of_copy_bandwidth": 0.9, "speedup_vs_sdpa_fp16": 9.0,
             **shape, "batch": 1, "tokens": 4096}]  # another shape: not this bound's
    run = {"device": "GPU", "commit": "abc1234", "date": "2026-11-23", "copy_bandwidth_gbps": 3000.0, "kv_heads": 8, "results": rows}
    (tmp_path / "decode_tc_gpu.json").write_text(json.dumps({**run, "head_dim": 128}))
    (tmp_path / "decode_tc_gpu_d256.json").write_text(json.dumps({**run, "head_dim": 256, "commit": "def5678"}))
    runs = bd.measured_on_gpus(tmp_path)
    assert [r["commit"] for r in runs] == ["abc1234"] and runs[0]["variants"]["int2-g128"]["latency_us"] == 126.0
    kernel = bd.TensorCoreKernel()
    walk = {"case": "int2 g128 (KIVI)", "bound": {"bandwidth_fraction": 0.858, "speedup_vs_sdpa": 6.78}}
    table = bd.measured_table([walk], kernel, runs)
    assert table[-1] == "| int2 g128 (KIVI) | 85.8% | - | 40.0% | 6.78x | - | 2.90x | - | GPU, abc1234, 2026-11-23 |"
    assert bd.measured_table([{**walk, "case": "int4 g128 (KIVI)"}], kernel, runs) == []
    # with a calibrated model: its latencies on the run's device, and their errors against the measured one; int2's
    # 32-byte pieces of 256-byte rows touch a line each, so the per-line reading pays its constant twice a token
    counts = {"warp_instructions_per_token": 16.0, "shared_wavefronts_per_token": 2.0, "bytes_per_token": 72.0,
              "code_bytes": [32, 32]}
    calibration = {"token": {"per_instruction": 0.5, "constant": 30.0}, "line": {"per_instruction": 0.5, "constant": 15.0}}
    us = (0.5 * 16 + 4 * 2 + 30) * bd.KV_HEAD_TOKENS / bd.SLOTS_PER_S * 1e6  # compute-bound at 3 TB/s
    for reading in ("token", "line"):
        assert math.isclose(bd.predicted_us({**walk, **counts}, calibration, 3e12, 151257088, reading=reading), us)
    cells = bd.measured_table([{**walk, **counts}], kernel, runs, calibration)[-1].split(" | ")
    fraction, error = f"{151257088 / 3e12 * 1e6 / us:.1%}", f"{us / 126.0 - 1:+.0%}"
    assert cells[2] == f"{fraction} / {fraction}" and cells[7] == f"{error} / {error}"
    # one KV head (Gemma 3's): an eighth of the tokens, so an eighth of the per-token latency; its pieces lie end to
    # end, a quarter of a line a side a token, so the per-line constant is paid half a time
    one = [{**r, "bytes_read": 151257088 // 8, "latency_us": 20.0} for r in rows]
    (tmp_path / "decode_tc_gpu_kv1.json").write_text(json.dumps({**run, "head_dim": 128, "kv_heads": 1, "results": one}))
    runs = bd.measured_on_gpus(tmp_path)
    assert [(r["kv_heads"], r["kv_head_tokens"]) for r in runs] == [(8, bd.KV_HEAD_TOKENS), (1, bd.KV_HEAD_TOKENS // 8)]
    cells = bd.measured_table([{**walk, **counts}], kernel, runs, calibration)[-1].split(" | ")
    fewer = (0.5 * 16 + 4 * 2 + 15 * 0.5) * bd.KV_HEAD_TOKENS / 8 / bd.SLOTS_PER_S * 1e6
    assert cells[7] == f"{us / 8 / 20.0 - 1:+.0%} / {fewer / 20.0 - 1:+.0%}" and cells[8] == "GPU, abc1234, 2026-11-23, 1 KV head |"
    # the same codes with each KV head's rows together: the same KV-head tokens and per-token prediction, named so
    heads = [{**r, "latency_us": r["latency_us"] * 0.5} for r in rows]
    (tmp_path / "decode_tc_gpu_heads.json").write_text(json.dumps({**run, "head_dim": 128, "layout": "heads", "results": heads}))
    runs = bd.measured_on_gpus(tmp_path)
    assert [(r["kv_head_tokens"], r["layout"]) for r in runs] == [(bd.KV_HEAD_TOKENS, "rows"), (bd.KV_HEAD_TOKENS, "heads"),
                                                                  (bd.KV_HEAD_TOKENS // 8, "rows")]
    cells = bd.measured_table([{**walk, **counts}], kernel, runs, calibration)[-2].split(" | ")
    fewer *= 8
    assert cells[7] == f"{us / 63.0 - 1:+.0%} / {fewer / 63.0 - 1:+.0%}"
    assert cells[8] == "GPU, abc1234, 2026-11-23, each KV head's rows together |"


def test_lines_a_token_touches_in_each_layout():
    """Rows whole, a KV head's piece of each row shares its lines with the other heads' (a 48-byte one straddles a
    line at a quarter of the heads); each KV head's rows together, its pieces lie end to end."""
    assert bd.lines_per_token((32, 32), 8, "rows") == 2.0
    assert bd.lines_per_token((48, 48), 8, "rows") == 2.5
    assert bd.lines_per_token((256, 256), 8, "rows") == 4.0  # fp16 at head_dim 128: two whole lines a side
    assert math.isclose(bd.lines_per_token((32, 32), 8, "heads"), 0.5)
    assert math.isclose(bd.lines_per_token((48, 48), 8, "heads"), 0.75)
    assert bd.lines_per_token((32, 32), 1, "rows") == bd.lines_per_token((32, 32), 1, "heads")  # one head: one layout
    assert math.isclose(bd.lines_per_token((32, 64), 2, "rows"), 0.5 + 1.0)  # 64-byte rows: two tokens' keys a line
    case = next(c for c in bd.TensorCoreKernel.cases if c.name == "int2 keys, int4 values, g32 (KVmix's)")
    assert bd.code_bytes(case, 128) == (32, 64) and bd.code_bytes(bd.TensorCoreKernel.cases[0], 256) == (512, 512)


def test_the_calibration_fits_the_newest_run_off_the_memory_roofline():
    """calibrate fits tools.decode_model in both readings to the newest run's variants under 80% of copy bandwidth
    (fp16 rows at the roofline say nothing about the issue side) with rows whole, and reports each one's error in the
    fit and left out."""
    kernel = bd.TensorCoreKernel()
    counts = {"int2 g128 (KIVI)": (16.0, 2.3), "int4 g128 (KIVI)": (22.0, 4.1), "nuq3 pre-RoPE 1%": (48.0, 20.1),
              "fp16": (18.0, 8.2)}
    walks = [{"case": case, "warp_instructions_per_token": n, "shared_wavefronts_per_token": w} for case, (n, w) in counts.items()]
    measured = {c.name: c.measured for c in kernel.cases}
    truth = dm.Model(0.5, 30.0)

    def run(date, scale):
        variants = {measured[case]: {"latency_us": scale * truth.slots(n, w) * bd.KV_HEAD_TOKENS / bd.SLOTS_PER_S * 1e6,
                                     "fraction_of_copy_bandwidth": 0.98 if case == "fp16" else 0.4}
                    for case, (n, w) in counts.items()}
        return {"device": "GPU", "commit": date[-2:], "date": date, "copy_bytes_per_s": 3e12, "kv_heads": bd.SHAPE["kv_heads"],
                "kv_head_tokens": bd.KV_HEAD_TOKENS, "layout": "rows", "variants": variants}

    # (a newer run with each KV head's rows together tells the readings apart: compared, never fitted)
    runs = [run("2026-11-28", 1.0), run("2026-11-20", 2.0), {**run("2026-11-29", 0.5), "layout": "heads"}]
    fitted = bd.calibrate(walks, kernel, runs, same_kernels=lambda commit: commit in ("28", "29"), walked_at="abc1234")
    token, line = fitted["token"], fitted["line"]
    assert fitted["date"] == "2026-11-28" and fitted["walked_at"] == "abc1234" and set(token["fit_error"]) == set(line["fit_error"]) == set(counts) - {"fp16"}
    assert math.isclose(token["per_instruction"], 0.5) and math.isclose(token["constant"], 30.0)
    assert all(abs(e) < 1e-9 for e in token["leave_one_out"].values())
    # every variant here touches 2 lines a token but nuq3 (2.5): the per-line reading fits them nearly as well
    assert line["constant"] > 0 and max(abs(e) for e in line["fit_error"].values()) < 0.1
    # two variants: nothing left to check the fit with
    assert bd.calibrate(walks[:2], kernel, runs[:1], same_kernels=lambda commit: True) is None
    # kernels/ changed since the newest run: its measurements are of other code, and the last fit is kept
    assert bd.calibrate(walks, kernel, runs, previous=fitted, same_kernels=lambda commit: False) is fitted


def test_walks_from_a_commit_without_a_written_bound_is_refused_before_compiling(capsys):
    with pytest.raises(SystemExit) as refused:
        bd.main(["--walks-from", "0" * 40])
    assert refused.value.code == 2 and "git has no benchmarks/results/bound_decode.json at that commit" in capsys.readouterr().err


def test_kernels_same_compares_a_commit_with_the_working_tree_or_another_commit():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=bd.REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "kernels/"], cwd=bd.REPO).returncode != 0
    assert bd.kernels_same(head) is not dirty
    assert bd.kernels_same(head, head)
    assert not bd.kernels_same("0" * 40)  # a commit git does not know


def test_occupancy_from_registers_and_shared_memory():
    assert bd.occupancy(219, 25104, "sm_90") == {"blocks_per_sm": 2, "warps_per_sm": 8, "limited_by": "registers"}
    assert bd.occupancy(24, 0, "sm_90") == {"blocks_per_sm": 16, "warps_per_sm": 64, "limited_by": "warps"}
    assert bd.occupancy(32, 60000, "sm_80")["limited_by"] == "shared memory"


def test_shared_memory_from_the_ptxas_report_of_either_architecture():
    log = ("ptxas info    : Function properties for A\nptxas         .     0 bytes stack frame\n"
           "ptxas info    : Used 103 registers, used 1 barriers, 14864 bytes smem, 440 bytes cmem[0]\n"  # sm_80
           "ptxas info    : Function properties for B\nptxas info    : Used 29 registers, used 0 barriers, 384 bytes cmem[0]\n"
           "ptxas info    : Function properties for C\nptxas info    : Used 219 registers, used 1 barriers, 25104 bytes smem\n")
    assert [bd.shared_bytes(log, name) for name in "ABC"] == [14864, 0, 25104]


def test_a_cp_async_pipeline_keeps_its_stages_in_flight(model, monkeypatch):
    """With a pipeline, in flight = the global-load bytes of a whole token-loop iteration x stages x warps: LISTING's
    loop issues one 16-byte load and three 2-byte loads per lane per iteration."""
    monkeypatch.setattr(model, "stages", lambda case: 3)
    code = sass.parse_listing(LISTING)["kern"].code
    result = bd.analyse(model, code, CASE, SOURCE.__getitem__, token_bytes=1000.0, warps_per_sm=8)
    assert result["in_flight_per_sm"]["pipeline"] == (16 + 3 * 2) * 32 * 3 * 8


@pytest.mark.parametrize("kernel", bd.KERNELS, ids=lambda k: k.source)
def test_the_kernel_models_decide_every_branch_of_todays_sass(kernel):
    """Every case of the kernel model walks on sm_90 (a kernel change that adds a branch no rule decides fails here, not
    in the benchmark), keeping the 16 KiB per SM in flight that HBM latency needs."""
    try:
        sass.nvdisasm()
    except SystemExit:
        pytest.skip("nvidia-cuda-nvdisasm is not installed")
    compiled, walks = bd.measure(kernel, "sm_90", 0.9, names=sorted({kernel.variant(case) for case in kernel.cases}))
    assert [w["case"] for w in walks] == [case.name for case in kernel.cases]
    for w in walks:
        assert math.isclose(sum(w["by_pass"].values()), w["warp_instructions_per_token"], rel_tol=1e-9)
        assert 0 < w["bound"]["bandwidth_fraction"] <= 1
        assert w["in_flight_per_sm"]["pipeline"] >= 16 * 1024
    assert all(row["spill_bytes"] == 0 for row in compiled)
    if isinstance(kernel, bd.TensorCoreKernel):  # one mma per 16 tokens for Q K (tokens in M) and for each m-tile of P V
        int2 = next(w for w in walks if w["case"] == "int2 g128 (KIVI)")
        assert 1.0 < int2["mma_per_token"] < 1.25  # Q K's 1/2 a token, P V's 1/2, the zeros' and the key blocks' bias


def test_the_tensor_core_model_walks_every_case_it_serves_at_head_dim_256():
    """The benchmark's second shape (Gemma 3's head_dim): every case the runtime serves there walks on sm_90, the
    pre-RoPE keys' rolled loop over a rotated key's parts included, and is bounded at that shape."""
    try:
        sass.nvdisasm()
    except SystemExit:
        pytest.skip("nvidia-cuda-nvdisasm is not installed")
    kernel = bd.TensorCoreKernel(bd.SHAPE_256)
    cases = kernel.served_cases()
    assert {case.name for case in kernel.cases} - {case.name for case in cases} == {"int2 g128, pre-RoPE keys", "int4 g128, pre-RoPE keys"}
    compiled, walks = bd.measure(kernel, "sm_90", 0.9)
    assert [w["case"] for w in walks] == [case.name for case in cases] and all(w["variant"].startswith("decode_tc<256,") for w in walks)
    assert all(row["spill_bytes"] == 0 for row in compiled)
    fp16 = walks[0]
    assert fp16["bytes_per_token"] == 2 * 256 * 2 and fp16["bound"]["t_sdpa_us"] == 2 * bd.bound(512, 1, 0.9)["t_sdpa_us"]
    for w in walks:
        assert math.isclose(sum(w["by_pass"].values()), w["warp_instructions_per_token"], rel_tol=1e-9)


def test_the_walk_reads_a_tokens_rope_row_once_at_both_head_dims():
    """Pre-RoPE codebook keys read each token's {cos, sin} row, D / 2 words, once: D / 2 x 4 bytes per KV token in
    16-byte loads of a whole warp (512 bytes each), in the block's pipeline and in a warp's own (its offset from the
    rotated query's position held per stage). Counts the rolled loop over a rotated key's parts at head_dim 256 (its
    trip rule) against that. A rope load is one on the rope row's line or addressed from a register that line
    computed last (ptxas gives some of its loads a neighbouring line's debug location)."""
    try:
        sass.nvdisasm()
    except SystemExit:
        pytest.skip("nvidia-cuda-nvdisasm is not installed")
    source = bd.source_lines("decode_attention_tc.cu")

    def on_rope_line(ins) -> bool:
        return any(module == "decode_attention_tc.cu" and "load_words(w, rope_lane + rope_row_start" in source[line - 1]
                   for module, line in ins.lines)

    for shape, case in ((bd.SHAPE, "nuq3 pre-RoPE 1%"), (bd.SHAPE, "nuq3 pre-RoPE, no outliers"), (bd.SHAPE_256, "nuq3 pre-RoPE 1%")):
        [(_, _, code, per_token)] = bd.walks_with_lines([case], shape)
        rope_loads, written_by = 0.0, {}  # register -> the instruction that wrote it last, in code order
        for ins, n in zip(code, per_token):
            if ins.opcode.startswith("LDS.128"):
                base = ins.operands.split("[")[1].split("+")[0].rstrip("]")
                rope_loads += n * (on_rope_line(ins) or (base in written_by and on_rope_line(written_by[base])))
            written_by[ins.operands.split(",")[0].strip()] = ins
        assert math.isclose(rope_loads, shape["head_dim"] // 2 * 4 / 512), (shape, case)


def test_a_campaign_writing_its_own_results_elsewhere_still_reads_the_committed_bound(tmp_path):
    """The GPU campaign points KVCAL_RESULTS_DIR at its output folder; the benchmark's predictions must still come
    from the bound committed in the repository (a campaign that printed none had nothing written down to compare)."""
    env = {**os.environ, "KVCAL_RESULTS_DIR": str(tmp_path)}
    script = "from tools import bound_decode as bd; p = bd.committed_predictions(); print(p is not None and 'int2-g128' in p['walks'])"
    done = subprocess.run([sys.executable, "-c", script], cwd=bd.REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_the_written_bound_predicts_the_benchmark_variants_it_walked(tmp_path):
    """committed_predictions maps the GPU benchmark's variant names to the written walk and calibration (nothing
    before a calibration was written), and predicted_us gives their latency on a device."""
    import json

    assert bd.committed_predictions(tmp_path) is None
    walk = {"case": "int2 g128 (KIVI)", "warp_instructions_per_token": 16.0, "shared_wavefronts_per_token": 2.0,
            "bytes_per_token": 72.0, "code_bytes": [32, 32]}
    calibration = {"token": {"per_instruction": 0.5, "constant": 30.0}, "line": {"per_instruction": 0.5, "constant": 15.0}}
    bound = {"commit": "abc1234", "sm_90": {"decode_attention_tc.cu": {"cases": [walk]}}}
    (tmp_path / "bound_decode.json").write_text(json.dumps(bound))
    assert bd.committed_predictions(tmp_path) is None
    bound["calibration"] = {"decode_attention_tc.cu": calibration}
    (tmp_path / "bound_decode.json").write_text(json.dumps(bound))
    written = bd.committed_predictions(tmp_path)
    assert written["commit"] == "abc1234" and written["walks"] == {"int2-g128": walk}
    assert math.isclose(bd.predicted_us(walk, written["calibration"], 3e12),
                        (0.5 * 16 + 4 * 2 + 30) * bd.KV_HEAD_TOKENS / bd.SLOTS_PER_S * 1e6)
    # head_dim 256: its own walks where they were written; no other shape
    assert bd.committed_predictions(tmp_path, bd.SHAPE_256) is None
    wide = {**walk, "bytes_per_token": 144.0}
    bound["sm_90_d256"] = {"decode_attention_tc.cu": {"cases": [wide]}}
    (tmp_path / "bound_decode.json").write_text(json.dumps(bound))
    assert bd.committed_predictions(tmp_path, bd.SHAPE_256)["walks"] == {"int2-g128": wide}
    assert bd.committed_predictions(tmp_path, {**bd.SHAPE, "tokens": 4096}) is None
    # one KV head (Gemma 3's): the same walks, predicted over its KV-head tokens
    assert bd.committed_predictions(tmp_path, {**bd.SHAPE_256, "kv_heads": 1})["walks"] == {"int2-g128": wide}
    assert math.isclose(bd.predicted_us(walk, written["calibration"], 3e12, kv_head_tokens=bd.KV_HEAD_TOKENS // 8),
                        (0.5 * 16 + 4 * 2 + 30) * bd.KV_HEAD_TOKENS / 8 / bd.SLOTS_PER_S * 1e6)
