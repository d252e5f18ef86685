"""Developer tools that are not benchmarks: `bound_decode`, the static bound of the decode kernels from their SASS
(read by `sass`), `decode_model`, its calibrated prediction, and `kernel_emulation`, the kernels run on the CPU."""
