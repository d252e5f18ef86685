"""Reading the SASS of a kernel: nvdisasm's listing parsed into functions (instructions, branch targets, inlined
source lines), each opcode's class, pipe and shared-memory wavefronts, and the walk that counts how often each
instruction of a loop issues in the steady state. tools/bound_decode.py turns the counts into the bound; the kernel
model it passes (`kernel`: token_loop, inner_loops, sites, conditions, if_bodies) states the steady state of a case.

Loops. nvdisasm 13 turns its own dataflow analysis (and so -cfg) off for these cubins, so the control flow is
read from the listing's branch targets. Every backward branch closes a loop: its target is the header and the
loop is the address range from the target to the branch (ptxas lays loops out contiguously). The token loop is the
loop whose backward branch comes from the kernel model's token_loop source line, a warp's loop over tiles (the
kernel models' docstrings say what one iteration holds). One iteration serves a warp's tokens of one KV head
(tokens_per_iteration) for all query heads of its group, and warp-instructions per KV token = instructions issued
per iteration / those tokens.

Issued instructions per iteration. Expected executions of each instruction are propagated through the loop
body in address order. An inner loop's header gets its entry flow times its iterations (inner_loops: a regex
on the source line of its backward branch and the steady-state count); the whole entry flow leaves at its
last backward branch (or at its first exit when that branch is unconditional), so branches that leave a loop
early carry nothing. A conditional branch is resolved, in this order, by the kernel model's conditions() (the
branch compares a runtime value with an immediate: the GQA group, the layout id, a null fp16 row pointer; evaluated on the ISETP
that sets its predicate); a compiler slow path (a block ending in a CALL) never runs; a guard that jumps over a
loop is not taken when the loop runs; sites(), for the steady state of each case (a body token of the case's
code width, every lane valid, the warp converged): the probability that the code of a source line runs when
reached, read from the inlined lines of the block each side leads to, unless other paths join there (0 for the
fp16-token path, the other layouts, outliers when there are none; in_rows_share() for applying an outlier the
warp visits); if_bodies() for an if whose body no site names. A branch that no rule decides is an error (the steady
state is stated, never guessed), and so is an iteration whose flow does not reach its end. Divergence checks
(BRA.DIV) are not taken. Predicated instructions count whether or not their predicate holds: the warp issues them.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np

CLASSES = ("loads", "fp32", "int/logic", "conversion", "control", "other")
_CLASS_OF = {  # opcode (before the first '.') -> class; anything else is "other" (fp64, fp16x2, shuffles, stores, MMA)
    **dict.fromkeys(("LDG", "LDS", "LDC", "ULDC", "LD", "LDL", "LDSM", "LDGSTS", "LDTRAM"), "loads"),
    **dict.fromkeys(("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "MUFU", "FSWZADD", "FADD32I",
                     "FMUL32I", "FFMA32I"), "fp32"),
    **dict.fromkeys(("IADD3", "IADD", "IMAD", "IMUL", "ISETP", "LOP3", "LOP", "SHF", "SHL", "SHR", "LEA", "SEL", "MOV",
                     "MOV32I", "IABS", "IMNMX", "VIADD", "VIMNMX", "VIADDMNMX", "PLOP3", "PRMT", "BMSK", "BFE", "BFI", "FLO", "POPC",
                     "CS2R", "S2R", "S2UR", "UIADD3", "UIMAD", "ULOP3", "USHF", "UMOV", "ULEA", "UISETP", "USEL",
                     "UPRMT", "R2UR", "P2R", "R2P", "UFLO", "UPOPC", "USGXT", "SGXT", "IDP", "VABSDIFF"), "int/logic"),
    **dict.fromkeys(("I2F", "F2I", "I2FP", "F2FP", "F2F", "I2I", "FRND", "F2IP", "I2IP"), "conversion"),
    **dict.fromkeys(("BRA", "BRX", "JMP", "JMX", "BSSY", "BSYNC", "BREAK", "BMOV", "EXIT", "RET", "CALL", "WARPSYNC",
                     "NOP", "BAR", "DEPBAR", "YIELD", "ENDCOLLECTIVE", "KILL", "NANOSLEEP"), "control"),
}
# the opcodes the ALU pipe executes (Nsight Compute's pipe_alu): bit manipulation and logic, integer add, compare,
# select and min / max (not IMAD / IMUL: the FMA pipe's), fp32 compare, select and min / max, fp32 -> fp16 packing
ALU_PIPE = frozenset(("LOP3", "LOP", "IADD3", "IADD", "SHF", "SHL", "SHR", "LEA", "SEL", "PRMT", "ISETP", "IMNMX", "VIMNMX",
                      "IABS", "BMSK", "BREV", "FLO", "POPC", "SGXT", "PLOP3", "P2R", "R2P", "MOV", "FMNMX", "FSETP", "FSEL",
                      "FSET", "HMNMX2", "F2FP"))
GLOBAL_LOADS = ("LDG", "LD", "LDGSTS")
LOAD_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}  # default 4


def shared_wavefronts(opcode: str) -> float:
    """Conflict-free shared-memory wavefronts (128 bytes each) of one warp-instruction: loads, stores and cp.async
    writes by their width, ldmatrix / stmatrix by their 8x8 matrices; 0 for anything else."""
    op, *parts = opcode.split(".")
    if op in ("LDSM", "STSM"):
        return float(next((int(p) for p in reversed(parts) if p in ("1", "2", "4")), 1))
    if op in ("LDS", "STS", "LDGSTS", "ATOMS"):
        return max(1.0, load_bytes(opcode) * 32 / 128)
    return 0.0


def classify(opcode: str) -> str:
    if opcode.startswith("HADD2.F32"):  # fp16 -> fp32 as ptxas writes it (-RZ + x.H0_H0)
        return "conversion"
    return _CLASS_OF.get(opcode.split(".")[0], "other")


def load_bytes(opcode: str) -> int:
    """Bytes one lane reads with a load (4 unless the opcode names another width)."""
    return next((LOAD_BYTES[m] for m in opcode.split(".")[1:] if m in LOAD_BYTES), 4)


# ------------------------------------------------------------------------------------------------- listing

@dataclass
class Instruction:
    address: int
    predicate: str  # "" or e.g. "!P5"
    opcode: str
    operands: str
    lines: tuple  # inlined source lines, innermost first: ((file name, line), ...)
    targets: list = field(default_factory=list)  # indices a branch may jump to (several for an indirect BRX)


@dataclass
class Function:
    name: str
    code: list[Instruction] = field(default_factory=list)


_SECTION = re.compile(r"^\s*\.section\s+\.text\.(\S+?),")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_LINE = re.compile(r'File "([^"]+)", line (\d+)')
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@(!?U?P\w+)\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_TARGETS = re.compile(r"`\((\.L_x_\d+)\)|BRANCH_TARGETS ([.\w,]+)")


def parse_listing(text: str) -> dict[str, Function]:
    """nvdisasm -c -gi output -> functions by name, with branch targets resolved and source lines attached."""
    functions, labels, branches = {}, {}, []
    function, lines, in_comment = None, (), False
    for raw in text.splitlines():
        if m := _SECTION.match(raw):
            function = functions[m.group(1)] = Function(m.group(1))
        elif function is None:
            continue
        elif m := _LABEL.match(raw.strip()):
            labels[function.name, m.group(1)] = len(function.code)
        elif raw.lstrip().startswith("//##"):
            # "File A, line N inlined at B, line M": one frame per comment line, innermost first
            frame = tuple((Path(f).name, int(n)) for f, n in _LINE.findall(raw))[:1]
            lines, in_comment = (lines + frame if in_comment else frame), True
        elif m := _INSTRUCTION.match(raw):
            in_comment = False
            function.code.append(Instruction(int(m.group(1), 16), m.group(2) or "", m.group(3), m.group(4), lines))
            if target := _TARGETS.search(raw):
                branches.append((function, len(function.code) - 1, (target.group(1) or target.group(2)).split(",")))
    for function, index, names in branches:
        function.code[index].targets = [labels[function.name, name] for name in names]
    return functions


def nvdisasm() -> Path:
    """The nvdisasm binary of the nvidia-cuda-nvdisasm wheel."""
    try:
        files = metadata.files("nvidia-cuda-nvdisasm") or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == "nvdisasm":
            return Path(file.locate())
    raise SystemExit("error: nvdisasm not found: pip install nvidia-cuda-nvdisasm (or pip install -e '.[bound]')")


def disassemble(cubin: bytes, line_info: bool) -> str:
    """nvdisasm's listing of the code sections, with inlined source lines when the cubin has line info."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([str(nvdisasm()), "-c", *(["-gi"] if line_info else []), f.name], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"error: nvdisasm failed: {run.stderr.strip()}")
    return run.stdout


def same_code(a: Function, b: Function) -> bool:
    """The same instructions, labels compared by what they point at (label and subroutine numbers depend on the
    whole cubin)."""
    def key(f: Function) -> list:
        return [(i.predicate, i.opcode, re.sub(r"\.L_x_\d+|__internal_\d+_", "", i.operands), i.targets) for i in f.code]
    return key(a) == key(b)


# ------------------------------------------------------------------------------------------------- the walk

class WalkError(Exception):
    pass


def is_branch(ins: Instruction) -> bool:
    """A jump: BRA, BRX, and CALL.REL.NOINC to a label (sm_80 code leaves loops that way; it never returns)."""
    return ins.opcode.split(".")[0] in ("BRA", "BRX", "CALL") and bool(ins.targets)


def backward_branches(code: list[Instruction]) -> list[tuple[int, int]]:
    """(target, branch) of every backward branch: each closes a loop over that address range. Divergence
    fallbacks placed after the function's body jump back too; they are not inside the token loop."""
    return [(ins.targets[0], i) for i, ins in enumerate(code) if is_branch(ins) and ins.targets[0] <= i]


class Walk:
    """Expected executions of each instruction of `code` per iteration of the token loop, for one case of the
    kernel model `kernel` (whose rules take the case)."""

    def __init__(self, code: list[Instruction], source_text, case, kernel):
        self.code = code
        self.text = lambda lines: [source_text(f)[n - 1] for f, n in lines]
        self.entries = Counter(t for ins in code if is_branch(ins) for t in ins.targets)  # jumps into each label
        backward = backward_branches(code)
        token = [(h, e) for h, e in backward if self.matches(code[e].lines[:1], kernel.token_loop)]
        if len(token) != 1:
            raise WalkError(f"{len(token)} loops come from the token loop's line /{kernel.token_loop}/")
        self.header, self.end = token[0]
        self.loops = {}  # inner loops: header -> last backward branch
        for h, e in backward:
            if self.header < h and e < self.end:
                self.loops[h] = max(e, self.loops.get(h, e))
        self.sites, self.trips = kernel.sites(case), kernel.inner_loops(case)
        self.conditions, self.if_bodies = kernel.conditions(case), kernel.if_bodies(case)

    def matches(self, lines, pattern: str) -> bool:
        return any(re.search(pattern, t) for t in self.text(lines))

    def streams(self, header: int) -> str | None:
        """The side whose codes the loop at `header` streams, if any."""
        latch = self.code[self.loops[header]]
        return next((side for pattern, _, side in self.trips if self.matches(latch.lines[:1], pattern)), None)

    def trip_count(self, header: int) -> float:
        latch = self.code[self.loops[header]]
        found = [n for pattern, n, _ in self.trips if self.matches(latch.lines[:1], pattern)]
        if len(found) != 1:
            raise WalkError(f"loop at {self.code[header].address:#x} (source: {self.text(latch.lines[:1])}) has "
                            f"{len(found)} iteration rules")
        return found[0]

    def block(self, start: int) -> list[Instruction]:
        """The straight-line code from `start` to the next branch or label."""
        end = start
        while (end < len(self.code) - 1 and not is_branch(self.code[end]) and not self.code[end].opcode.startswith("CALL")
               and end + 1 not in self.entries):
            end += 1
        return self.code[start:end + 1]

    def joins(self, start: int) -> bool:
        """Whether the code at `start` is reached from more than one place (so says nothing about one branch)."""
        prev = self.code[start - 1]
        falls_in = bool(prev.predicate) or "DIV" in prev.opcode or prev.opcode.split(".")[0] not in ("BRA", "BRX", "EXIT", "RET")
        return self.entries[start] + falls_in > 1

    def runs(self, start: int) -> float | None:
        """Probability that the block at `start` runs when reached, from sites(); None when no rule names it or when
        other paths join there. A block that holds the code of several sites (ptxas predicated a rare path into the
        block of a likely one) runs as often as the likeliest."""
        if self.joins(start):
            return None
        found = set()
        for ins in self.block(start):
            rates = {p for pattern, p in self.sites if self.matches(ins.lines, pattern)}
            if len(rates) > 1:  # the rules cannot tell this instruction's path: its source line holds two sites' code
                raise WalkError(f"{ins.address:#x} ({self.text(ins.lines[:1])}): rules of rates {sorted(rates)} name its "
                                "lines; give each path a line of its own")
            found |= rates
        return max(found) if found else None

    def taken(self, i: int) -> float:
        """Probability that the conditional branch at i jumps."""
        ins = self.code[i]
        for pattern, value in self.conditions:
            if self.matches(ins.lines[:1], pattern):
                return float(self.compare(i, value))
        for start, p in ((ins.targets[0], 0.0), (i + 1, 1.0)):  # compiler slow paths (a CALL) do not run
            last = self.block(start)[-1]
            if last.opcode.startswith("CALL") and not is_branch(last):
                return p
        for header in (i + 1, i + 1 + len(self.block(i + 1))):  # a guard jumps over a loop its fall-through enters
            if header in self.loops and ins.targets[0] > self.loops[header]:
                return 0.0 if self.trip_count(header) else 1.0
        jump, fall = self.runs(ins.targets[0]), self.runs(i + 1)
        if jump is not None and fall is not None and jump + fall != 1:
            raise WalkError(f"branch at {ins.address:#x}: rules give jump {jump} to {self.describe(ins.targets[0])} "
                            f"and fall-through {fall} to {self.describe(i + 1)}")
        if jump is None and fall is None:
            body = next((p for pattern, p in self.if_bodies if self.matches(ins.lines[:1], pattern)), None)
            joins = self.joins(ins.targets[0]), self.joins(i + 1)
            if body is not None and joins[0] != joins[1]:  # an if without else: the body is the side nothing joins
                return 1 - body if joins[0] else body
            raise WalkError(f"branch at {ins.address:#x} ({self.text(ins.lines[:1])}): no rule decides between "
                            f"{self.describe(ins.targets[0])} and {self.describe(i + 1)}")
        return jump if jump is not None else 1 - fall

    def compare(self, i: int, value: int) -> bool:
        """Whether the branch at i jumps when the register its predicate's ISETP compares holds `value`."""
        negate, predicate = self.code[i].predicate.startswith("!"), self.code[i].predicate.lstrip("!")
        for j in range(i - 1, self.header - 1, -1):
            writer = self.code[j]
            if writer.operands.split(",")[0].strip() != predicate:
                continue
            m = re.fullmatch(r"ISETP\.(LT|LE|GT|GE|EQ|NE)(?:\.U32)?\.AND(\.EX)?", writer.opcode)
            ops = [o.strip() for o in writer.operands.split(",")]
            # .EX: the high half of a 64-bit comparison with zero, chained to the low half's predicate
            chained = m and m.group(2) and ops[3] == "RZ" and m.group(1) in ("EQ", "NE")
            if not m or ops[1] != "PT" or not (ops[4] == "PT" or chained):
                break
            a, b = value, None  # the ISETP's left and right operands: the runtime value against an immediate
            if ops[3] == "RZ" or ops[3].startswith("0x"):
                b = 0 if ops[3] == "RZ" else int(ops[3], 16)
            elif ops[3].startswith("c[") and (moved := self.moved_immediate(ops[2], j)) is not None:
                a, b = moved, value  # or an immediate moved into a register against the kernel parameter (c[...])
            if b is None:
                break
            result = {"LT": a < b, "LE": a <= b, "GT": a > b, "GE": a >= b, "EQ": a == b, "NE": a != b}[m.group(1)]
            return result != negate
        raise WalkError(f"branch at {self.code[i].address:#x}: its predicate is not an ISETP against an immediate")

    def moved_immediate(self, register: str, before: int) -> int | None:
        """The immediate the last write before instruction `before` put in `register` (MOV, IMAD.MOV, or ptxas' HFMA2.MMA
        of -RZ * RZ plus two fp16 constants, the halves of the word), or None."""
        for j in range(before - 1, self.header - 1, -1):
            opcode, ops = self.code[j].opcode, [o.strip() for o in self.code[j].operands.split(",")]
            if ops[0] != register:
                continue
            if opcode == "HFMA2.MMA" and ops[1:3] == ["-RZ", "RZ"]:
                high, low = (int(np.float16(float(x)).view(np.uint16)) for x in ops[3:5])
                return high << 16 | low
            moved = ops[1] if opcode == "MOV" else ops[3] if opcode == "IMAD.MOV.U32" else ""
            return int(moved, 16) if moved.startswith("0x") else None
        return None

    def describe(self, start: int) -> str:
        return f"{self.code[start].address:#x} {sorted(set(t.strip() for ins in self.block(start) for t in self.text(ins.lines)))}"

    def innermost(self, i: int) -> tuple[int, int] | None:
        inner = [(h, e) for h, e in self.loops.items() if h <= i <= e]
        return max(inner) if inner else None

    def run(self) -> list[float]:
        code, n = self.code, len(self.code)
        flow, count, entry = [0.0] * (n + 1), [0.0] * n, {}
        self.flow, flow[self.header] = flow, 1.0
        for i in range(self.header, self.end + 1):
            f, ins = flow[i], code[i]
            if i in self.loops:
                entry[i], f = f, f * self.trip_count(i)
            count[i] = f
            if not f:
                continue
            op = ins.opcode.split(".")
            if op[0] in ("EXIT", "RET", "CALL", "JMP", "JMX") and not ins.predicate and not is_branch(ins):
                raise WalkError(f"{ins.opcode} at {ins.address:#x} inside the token loop")
            if not is_branch(ins):
                flow[i + 1] += f  # predicated EXIT/RET: not taken in the steady state
                continue
            if op[0] == "BRX":  # a jump table: the one target that the rules say runs
                live = [t for t in ins.targets if self.runs(t) == 1.0]
                if len(live) != 1:
                    raise WalkError(f"BRX at {ins.address:#x}: {len(live)} live targets among "
                                    f"{[self.describe(t) for t in ins.targets]}")
                self.jump(i, live[0], f)
                continue
            target = ins.targets[0]
            if target <= i:  # a loop's backward branch
                if i == self.end:
                    if abs(f - 1) > 1e-6:  # what enters an iteration must reach its end
                        raise WalkError(f"{f:.3f} of the token loop's iteration reaches its end")
                    continue
                if self.loops[target] != i:
                    raise WalkError(f"loop at {code[target].address:#x} has several backward branches")
                if ins.predicate:
                    flow[i + 1] += entry[target]  # the whole entry flow leaves at the end
                else:
                    exits = [j for j in range(target, i) if is_branch(code[j]) and code[j].targets[0] > i]
                    if not exits:
                        raise WalkError(f"loop at {code[target].address:#x} has no exit")
                    flow[code[exits[0]].targets[0]] += entry[target]
                continue
            loop_end = self.innermost(i)[1] if self.innermost(i) else self.end
            if "DIV" in op or target > loop_end:
                p = 0.0  # warp converged; leaving a loop is accounted at its end
            elif not ins.predicate:
                p = 1.0
            else:
                p = self.taken(i)
            if p:
                self.jump(i, target, f * p)
            flow[i + 1] += f * (1 - p)
        return count

    def jump(self, i: int, target: int, f: float) -> None:
        if not self.header <= target <= self.end:
            raise WalkError(f"branch at {self.code[i].address:#x} leaves the token loop in the steady state")
        self.flow[target] += f


def line_profile(code: list[Instruction], count: list[float], tokens: int) -> list[tuple[tuple, float, float]]:
    """(innermost source line, warp-instructions per KV token, shared wavefronts per KV token) of each line the walk's
    count reaches, most instructions first; instructions without a line fall under ("", 0)."""
    instructions, wavefronts = Counter(), Counter()
    for ins, n in zip(code, count):
        if n:
            where = ins.lines[0] if ins.lines else ("", 0)
            instructions[where] += n / tokens
            wavefronts[where] += n * shared_wavefronts(ins.opcode) / tokens
    return [(where, instructions[where], wavefronts[where]) for where in sorted(instructions, key=lambda w: (-instructions[w], w))]
