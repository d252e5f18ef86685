"""tools/sass.py: the SASS listing parser, the steady-state walk (loops, branch rules, flow), the instruction classes
and shared-memory wavefronts on hand-written input; the installed nvdisasm's output format where it is installed."""

import math
import struct
import subprocess

import pytest

from helpers.sass_listing import LISTING, SOURCE, ToyKernel
from tools import sass


@pytest.fixture
def model():
    return ToyKernel()


def walk(kernel):
    code = sass.parse_listing(LISTING)["kern"].code
    w = sass.Walk(code, SOURCE.__getitem__, None, kernel)  # ToyKernel's rules ignore the case
    return code, w, w.run()


def test_parse_listing_reads_labels_predicates_and_inlined_lines():
    code = sass.parse_listing(LISTING)["kern"].code
    assert [i.address for i in code] == list(range(0, 0x100, 0x10))
    assert code[1].lines == (("k.cu", 2), ("k.cu", 1))  # innermost first
    assert (code[3].predicate, code[3].opcode, code[3].targets) == ("!P0", "BRA", [5])
    assert code[-1].targets == [6] and sass.backward_branches(code) == [(10, 11), (1, 12), (6, 15)]


def test_walk_counts_one_token_loop_iteration(model):
    code, w, count = walk(model)
    by_address = {i.address: n for i, n in zip(code, count)}
    assert (w.header, w.end, w.loops) == (1, 12, {10: 11})  # the fallback's jump back is not a loop of the token loop
    assert by_address[0x40] == 0  # query head g = 4 is past a group of 4: ISETP 4 >= 5 is false, !P0 jumps
    assert by_address[0x80] == 0.25 and by_address[0x70] == 0.75
    assert by_address[0xa0] == by_address[0xb0] == 3  # the guard at 0x90 is not taken: the loop runs 3 times
    assert by_address[0xc0] == 1 and by_address[0xe0] == 0  # BRA.DIV: the warp is converged
    assert math.isclose(sum(count), 14.0)


def test_line_profile_puts_each_instruction_under_its_innermost_line(model):
    code, _, count = walk(model)
    rows = sass.line_profile(code, count, model.tokens_per_iteration(None))
    # line 5: the inner loop's load and latch, 3 times; line 2: the load inlined into line 1 and the branches around
    # rare() (line 4, a quarter of the time)
    assert [(where, n) for where, n, _ in rows] == [(("k.cu", 5), 6 / 4), (("k.cu", 2), 4.75 / 4), (("k.cu", 3), 2 / 4),
                                                    (("k.cu", 1), 1 / 4), (("k.cu", 4), 0.25 / 4)]
    assert math.isclose(sum(n for _, n, _ in rows), sum(count) / 4) and all(w == 0 for *_, w in rows)  # no shared memory


def test_a_branch_no_rule_decides_is_an_error(model, monkeypatch):
    monkeypatch.setattr(model, "sites", lambda case: [])
    with pytest.raises(sass.WalkError, match="no rule decides"):
        walk(model)


def test_a_line_two_site_rules_name_at_different_rates_is_an_error(model, monkeypatch):
    """A line holding the code of a likely and a rare path (a ternary) cannot tell the walk which path a block is."""
    monkeypatch.setattr(model, "sites", lambda case: [(r"rare\(\)", 0.25), (r"rare", 1.0)])
    with pytest.raises(sass.WalkError, match="give each path a line of its own"):
        walk(model)


def test_a_wrong_trip_rule_is_an_error(model, monkeypatch):
    monkeypatch.setattr(model, "inner_loops", lambda case: [])
    with pytest.raises(sass.WalkError, match="0 iteration rules"):
        walk(model)


def test_classify_and_load_widths():
    assert [sass.classify(op) for op in ("LDG.E.128", "FFMA", "IMAD.MOV.U32", "I2FP.F32.U32", "HADD2.F32", "BSSY", "SHFL.BFLY")] == \
        ["loads", "fp32", "int/logic", "conversion", "conversion", "control", "other"]
    assert [sass.load_bytes(op) for op in ("LDG.E.128.CONSTANT", "LDG.E.U16", "LDG.E", "LDG.E.64")] == [16, 2, 4, 8]
    # the ALU pipe: logic, integer add / compare / select and fp32 compares, not the FMA pipe's IMAD
    assert {"LOP3", "IADD3", "ISETP", "PRMT", "SEL", "FMNMX", "F2FP"} <= sass.ALU_PIPE
    assert not {"IMAD", "FFMA", "HFMA2", "HMMA", "LDS", "MUFU", "SHFL"} & sass.ALU_PIPE


def test_shared_memory_wavefronts_are_counted_conflict_free_by_width():
    widths = ("LDS", "LDS.U16", "LDS.64", "LDS.128", "STS.128", "LDSM.16.M88.4", "LDSM.16.MT88.2", "LDGSTS.E.BYPASS.128",
              "LDG.E.128", "FFMA")
    assert [sass.shared_wavefronts(op) for op in widths] == [1, 1, 2, 4, 4, 4, 2, 4, 0, 0]


def test_the_installed_nvdisasm_prints_what_the_parser_reads(tmp_path):
    """Three sm_90 instructions of a split merge's loop (a load, a compare, the loop's predicated branch) as raw encodings
    (no NVRTC: its first compile alone takes seconds)."""
    try:
        tool = sass.nvdisasm()
    except SystemExit:
        pytest.skip("nvidia-cuda-nvdisasm is not installed")
    words = ((0x000000061C177981, 0x000EA2000C1E9900), (0x0000000C1200780C, 0x000FE40003F24270),
             (0xFFFFFFFC00201947, 0x000FEC000383FFFF))
    raw = tmp_path / "code.bin"
    raw.write_bytes(b"".join(struct.pack("<QQ", *w) for w in words))
    out = subprocess.run([str(tool), "-b", "SM90", str(raw)], capture_output=True, text=True, check=True).stdout
    parsed = [m.group(2, 3) for line in out.splitlines() if (m := sass._INSTRUCTION.match(line))]
    assert parsed == [(None, "LDG.E.CONSTANT"), (None, "ISETP.GT.AND"), ("P1", "BRA")]
    assert [sass.classify(op) for _, op in parsed] == ["loads", "int/logic", "control"]
