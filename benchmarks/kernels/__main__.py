from benchmarks.harness import dispatch
from benchmarks.kernels import MODES

dispatch("kernels", MODES)
