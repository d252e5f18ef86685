"""What kvcal writes for other engines to load: vLLM's FP8 KV-cache scales in a compressed-tensors model folder
(`vllm`), from the FP8 quantizer (`fp8`), the scale search on a profile (`scales`), the compressed-tensors
description (`compressed_tensors`) and atomic output folders (`folder`)."""
