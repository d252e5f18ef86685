"""benchmarks/kernels/ncu.py: reading ncu's raw counters (the profiling itself needs a CUDA GPU and ncu) and its
argument errors."""

import csv
import io

import pytest

from benchmarks import common
from benchmarks.kernels import ncu as profile
from helpers import refused

# counters of int2 g128's launch as `ncu --page raw --csv` exported them on an H100 (ee93850; a subset of the columns)
INT2_G128 = [
    ("ID", "", "0"), ("Kernel Name", "", "void decode_tc<128, 2, 128, 128, 4, 0, 0, 0>(const float *, int)"),
    ("device__attribute_display_name", "", "NVIDIA H100 80GB HBM3"),
    ("dram__bytes_read.sum", "Mbyte", "154.510592"), ("dram__bytes_read.sum.pct_of_peak_sustained_elapsed", "%", "39.425494"),
    ("gpu__time_duration.sum", "ms", "0.116928"),
    ("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "", "10,080,377"),
    ("l1tex__throughput.avg.pct_of_peak_sustained_active", "%", "46.055989"),
    ("launch__occupancy_limit_blocks", "block", "32.000000"), ("launch__occupancy_limit_registers", "block", "4.000000"),
    ("launch__occupancy_limit_shared_mem", "block", "4.000000"), ("launch__occupancy_limit_warps", "block", "16.000000"),
    ("launch__registers_per_thread", "register/thread", "122"),
    ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "%", "57.752874"),
    ("sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active", "%", "45.464736"),
    ("sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active", "%", "29.327302"),
    ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "%", "21.383889"),
    ("smsp__inst_executed.sum", "inst", "56692926.000000"),
    ("smsp__issue_active.avg.pct_of_peak_sustained_active", "%", "55.157945"),
    ("smsp__pcsamp_sample_count", "", "12,604"),
    ("smsp__pcsamp_warps_issue_stalled_barrier", "warp", "1020"),
    ("smsp__pcsamp_warps_issue_stalled_barrier_not_issued", "warp", "350"),
    ("smsp__pcsamp_warps_issue_stalled_long_scoreboard", "warp", "967"),
    ("smsp__pcsamp_warps_issue_stalled_math_pipe_throttle", "warp", "1259"),
    ("smsp__pcsamp_warps_issue_stalled_not_selected", "warp", "1606"),
    ("smsp__pcsamp_warps_issue_stalled_selected", "warp", "2103"),
    ("smsp__pcsamp_warps_issue_stalled_short_scoreboard", "warp", "1344"),
    ("smsp__pcsamp_warps_issue_stalled_wait", "warp", "2703"),
    ("smsp__pcsamp_warps_issue_stalled_wait_not_issued", "warp", "3128"),  # more than any reason: must not be listed
    ("smsp__warps_active.avg.per_cycle_active", "warp", "3.510567"),
    ("smsp__warps_eligible.avg.per_cycle_active", "warp", "1.037545"),
]


# the columns profile.EXTRA_METRICS adds, with values made up to check the reading (not a measurement)
L2_EXTRAS = [
    ("lts__d_sectors.avg.pct_of_peak_sustained_elapsed", "%", "20.5"),
    ("lts__t_sectors.avg.pct_of_peak_sustained_elapsed", "%", "31.04"),
    ("lts__t_tag_requests.avg.pct_of_peak_sustained_elapsed", "%", "55.0"),
    ("ltcfabric__cycles_active.avg.pct_of_peak_sustained_elapsed", "%", "40.0"),
    ("lts__t_requests_srcunit_tex_op_read.sum", "", "4,000,000"),
    ("lts__t_sectors_srcunit_tex_op_read.sum", "sector", "5,000,000"),
]


def exported(columns) -> str:
    out = io.StringIO()
    out.write("==PROF== Connected to process 1\n")  # ncu may print before the table
    writer = csv.writer(out, quoting=csv.QUOTE_ALL)
    for row in zip(*columns):
        writer.writerow(row)
    return out.getvalue()


def test_a_launch_s_counters_become_one_row_in_microseconds_and_megabytes_with_its_five_largest_stalls():
    row = profile.summary("int2-g128", exported(INT2_G128))
    assert row["device"] == "NVIDIA H100 80GB HBM3" and row["kernel"] == "void decode_tc<128, 2, 128, 128, 4, 0, 0, 0>"
    assert row["duration_us"] == 116.93 and row["dram_read_mb"] == 154.5  # ms -> us; Mbyte as is
    assert (row["registers"], row["blocks_per_sm"], row["shared_wavefronts"]) == (122, 4, 10080377)
    assert (row["warps_per_scheduler"], row["eligible_per_scheduler"], row["issue_pct"], row["l1_shared_pct"]) == (3.51, 1.04, 55.2, 46.1)
    # shares of all 12,604 samples, the *_not_issued subsets left out
    assert row["stall_samples_pct"] == {"wait": 21.4, "selected": 16.7, "not_selected": 12.7, "short_scoreboard": 10.7,
                                        "math_pipe_throttle": 10.0}


def test_the_l2_s_three_busiest_parts_and_its_sectors_per_read_request_are_read_where_ncu_gave_them():
    row = profile.summary("int2-g128", exported(INT2_G128 + L2_EXTRAS))
    # the aggregate (lts__throughput) is not one of its own parts
    assert row["l2_parts_pct"] == {"lts__t_tag_requests": 55.0, "ltcfabric__cycles_active": 40.0, "lts__t_sectors": 31.0}
    assert row["l2_sectors_per_read_request"] == 1.25
    plain = profile.summary("int2-g128", exported(INT2_G128))  # an ncu that refused them
    assert plain["l2_parts_pct"] == {} and plain["l2_sectors_per_read_request"] is None


def test_from_csv_tables_each_variant_with_its_l2_parts_or_a_dash_where_its_csv_lacks_them(tmp_path, monkeypatch):
    (tmp_path / "with.csv").write_text(exported(INT2_G128 + L2_EXTRAS))
    (tmp_path / "without.csv").write_text(exported(INT2_G128))
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr("sys.argv", ["ncu", "--from-csv", "--csv-dir", str(tmp_path), "--only", "with,without"])
    profile.main()
    table = (tmp_path / "results" / "profile_decode_tc_nvidia-h100-80gb-hbm3.md").read_text().splitlines()
    with_row, without_row = (next(line for line in table if line.startswith(f"| {v} |")) for v in ("with", "without"))
    assert "| lts__t_tag_requests 55.0%, ltcfabric__cycles_active 40.0%, lts__t_sectors 31.0% | 1.25 |" in with_row
    assert "| 57.8% | - | - |" in without_row


@pytest.mark.parametrize("arguments,problem", [
    (["--from-csv"], "--from-csv reads --csv-dir DIR"),
    (["--from-csv", "--csv-dir", ".", "--only", "int2-g128"], "no int2-g128.csv there"),
    (["--only", "int2-g128,int2-g129@heads"], "--only int2-g129@heads: not a variant of the tensor-core benchmark"),
])
def test_bad_arguments_exit_2_with_one_line_naming_the_problem_and_write_nothing(arguments, problem, monkeypatch, capsys):
    assert problem in refused(profile.main, arguments, monkeypatch, capsys)
