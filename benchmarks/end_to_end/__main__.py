from benchmarks.harness import dispatch
from benchmarks.end_to_end import MODES

dispatch("end_to_end", MODES)
