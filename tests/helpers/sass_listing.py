"""A hand-written SASS listing and the kernel model that states its steady state: the input of the tests of
tools/sass.py (the walk) and tools/bound_decode.py (what it makes of the counts)."""

# A token loop (.L_x_0 .. 0x0b0) holding a branch on the GQA group, a branch to rarely run code, an inner loop of
# 3 iterations (.L_x_3) and its guard; a divergence fallback after EXIT jumps back in, as ptxas lays them out.
LISTING = """
//--------------------- .text.kern --------------------------
\t.section\t.text.kern,"ax",@progbits
kern:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
\t//## File "k.cu", line 2 inlined at "k.cu", line 1
\t//## File "k.cu", line 1
        /*0010*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
\t//## File "k.cu", line 3
        /*0020*/                   ISETP.GE.AND P0, PT, R9, 0x5, PT ;
        /*0030*/              @!P0 BRA `(.L_x_1) ;
\t//## File "k.cu", line 2
        /*0040*/                   FFMA R4, R4, R5, R6 ;
.L_x_1:
        /*0050*/                   BRA.DIV UR4, `(.L_x_9) ;
.L_x_8:
        /*0060*/              @P1 BRA `(.L_x_2) ;
        /*0070*/                   BRA `(.L_x_4) ;
.L_x_2:
\t//## File "k.cu", line 4
        /*0080*/                   HADD2.F32 R7, -RZ, R7.H0_H0 ;
.L_x_4:
\t//## File "k.cu", line 2
        /*0090*/              @P2 BRA `(.L_x_5) ;
.L_x_3:
\t//## File "k.cu", line 5
        /*00a0*/                   LDG.E.U16 R8, desc[UR4][R2.64] ;
        /*00b0*/              @P3 BRA `(.L_x_3) ;
.L_x_5:
\t//## File "k.cu", line 1
        /*00c0*/              @P4 BRA `(.L_x_0) ;
        /*00d0*/                   EXIT ;
.L_x_9:
	//## File "k.cu", line 3
        /*00e0*/                   WARPSYNC 0xffffffff ;
        /*00f0*/                   BRA `(.L_x_8) ;
"""
SOURCE = {"k.cu": ["for (token loop) {", "  work();", "  if (g >= group) continue;", "  rare();", "  for (inner loop) {"]}


class ToyKernel:
    """A kernel model for LISTING: a token loop of 4 tokens an iteration with plain loads, an inner loop of 3 that
    streams values, rare() runs a quarter of the time."""

    source = "k.cu"
    token_loop = r"for \(token loop\)"
    passes = {"keys": "token loop", "softmax": "if", "values": "rare"}  # from lines 1, 3, 4

    def tokens_per_iteration(self, case):
        return 4

    def stages(self, case):
        return 1

    def if_bodies(self, case):
        return ()

    def inner_loops(self, case):
        return [(r"for \(inner loop\)", 3, "values")]

    def sites(self, case):
        return [(r"rare\(\)", 0.25)]

    def conditions(self, case):
        return [(r"if \(g >= group\)", 4)]
