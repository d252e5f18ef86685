"""The runtime cache against the simulation of `kvcal eval ppl` on SmolLM2-135M: per recipe bundle, 160 tokens
of wikitext-2 valid decoded one at a time through the runtime cache vs one simulated forward; prints the mean
NLL of each, fp's, and the first position whose logits differ by more than 1e-2.

Bundles: artifacts/runtime/{kvquant,mixed,skvq,kivi,kvmix}.safetensors (see the README).
Usage: python benchmarks/bench_runtime_vs_simulation.py [--tokens 160] [--recipes kvquant,mixed,skvq,kivi,kvmix]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import REPO, SHARED  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=160, help="tokens decoded one at a time")
    parser.add_argument("--recipes", default="kvquant,mixed,skvq,kivi,kvmix", help="bundles under artifacts/runtime/")
    args = parser.parse_args()
    from test_runtime_cache import decode_token_by_token

    from kvcal.adapters import adapt
    from kvcal.methods import artifact_method
    from kvcal.models import load_model
    from kvcal.simulate import StorageTally, simulated

    model, tokenizer, _ = load_model(None, "auto", "cpu")
    text = (SHARED / "data" / "wikitext-2" / "valid.txt").read_text()[:5000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens]

    def nll(logits):
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()

    with torch.inference_mode():
        print(f"fp NLL {nll(model(ids).logits):.4f}")
        for recipe in args.recipes.split(","):
            bundle = REPO / "artifacts" / "runtime" / f"{recipe}.safetensors"
            began = time.perf_counter()
            with simulated(model, adapt(model), artifact_method(str(bundle)), StorageTally()):
                simulated_logits = model(ids).logits
            runtime_logits, _ = decode_token_by_token(model, bundle, ids)
            apart = ((runtime_logits - simulated_logits).abs().amax(-1)[0] > 1e-2).nonzero()
            first = int(apart[0]) if len(apart) else None
            print(f"{recipe}: NLL simulated {nll(simulated_logits):.4f}, runtime {nll(runtime_logits):.4f}, first position "
                  f"with logits apart by > 1e-2: {first} ({time.perf_counter() - began:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
