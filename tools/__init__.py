"""Developer tools that are not benchmarks: `bound_decode`, the static bound of the decode kernels from their SASS."""
