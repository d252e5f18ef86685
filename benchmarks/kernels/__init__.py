"""The decode kernels: the CPU decode step (`cpu_step`), generate()'s memory on CPU (`cpu_memory`), the CPU appends (`cpu_append`), the CPU decode kernel by
store layout (`cpu_layout`) and on MLA's latent (`cpu_latent`), the tensor-core GPU
kernel alone (`tensor_core`) and as the runtime launches it (`runtime_decode`; both time with `gpu_timing`), an A/B
of the tensor-core kernel against another tree (`ab`), its Nsight Compute counters (`ncu`), a cache's reads by
layout alone (`layout`), and what the runtime's planner binds to each part of a decode step per recipe (`plan`)."""

# mode of `python -m benchmarks.kernels` -> (module, what it measures)
MODES = {
    "cpu": ("benchmarks.kernels.cpu_step", "a decode step of the runtime cache on CPU against DynamicCache, per build and threads"),
    "cpu-memory": ("benchmarks.kernels.cpu_memory", "peak and held memory of generate() on CPU per cache, each in a fresh process"),
    "cpu-append": ("benchmarks.kernels.cpu_append", "the compiled CPU appends against the torch codec, per recipe and side"),
    "cpu-layout": ("benchmarks.kernels.cpu_layout", "the CPU decode kernel on one cache kept in both store layouts"),
    "cpu-latent": ("benchmarks.kernels.cpu_latent", "the CPU decode kernel on MLA's latent against the torch reference"),
    "gpu": ("benchmarks.kernels.tensor_core", "every tensor-core variant against fp16 SDPA and copy bandwidth (CUDA)"),
    "runtime": ("benchmarks.kernels.runtime_decode", "a layer's decode step as the cache launches it, per codec (CUDA)"),
    "ab": ("benchmarks.kernels.ab", "the tensor-core kernel of this tree against another's, interleaved (CUDA)"),
    "ncu": ("benchmarks.kernels.ncu", "Nsight Compute counters of tensor-core variants (CUDA, ncu)"),
    "layout": ("benchmarks.kernels.layout", "one side of a cache read as the decode blocks read it, by layout, no arithmetic (CUDA)"),
    "plan": ("benchmarks.kernels.plan", "what serves each part of a decode step per recipe, on CUDA and CPU (no kernel runs)"),
}
