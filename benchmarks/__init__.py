"""kvcal's benchmark harnesses, run from the repository root as modules:

- `python -m benchmarks.accuracy`: perplexity change against real bits for every recipe and baseline (method sets for
  the ablations), on wikitext-2 test and held-out code;
- `python -m benchmarks.kernels cpu|gpu|runtime|ab|ncu`: the decode step and kernels on CPU and GPU;
- `python -m benchmarks.end_to_end cpu|gpu|profile`: generate() and the cache's memory on CPU and GPU, and profiling;
- `python -m benchmarks.gpu_campaign`: what a short GPU lease runs, in order;
- `python -m benchmarks.report`: docs/results.md and the README's table, generated from benchmarks/results/.

Each writes benchmarks/results/<name>.{json,md}, naming the commit it measured; `common` holds what they share."""
