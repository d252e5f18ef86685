"""benchmarks.end_to_end: what the long-context passkey report names as the recipe closest to fp, the host-side
benchmark of the CUDA decode step (a run, and an A/B of two trees), the MLA generate() benchmark (a run), the prompt
lookup benchmark (a run) and the short steps' (a run)."""

import json
import subprocess
import sys

import pytest

from benchmarks.common import REPO
from benchmarks.end_to_end.long_context import closest_to_fp
from helpers.tiny_models import SPARSE_LATENTS, from_transformers


def _row(method: str, correct: int, length: int = 4096, keys: int = 1) -> dict:
    return {"method": method, "correct": correct, "samples": 20, "length": length, "keys": keys}


def test_the_closest_recipe_is_the_best_retriever_within_the_bits_bound():
    """kvmix retrieves most but stores 4.1 bits, over the 3.6 bound; of the others mixed retrieves most (a tie goes to
    the fewer bits); a length or variant with no fp row, or no recipe within the bound, names none."""
    rows = [_row("fp", 18), _row("kvmix", 18), _row("kvquant", 15), _row("mixed", 16), _row("kivi", 16), _row("fp", 9, 8192)]
    bits = {"kvmix": 4.1, "kvquant": 3.5, "mixed": 3.0, "kivi": 3.4}
    assert closest_to_fp(rows, bits, 1, 4096) == "mixed (3.00 bits): 2 fewer than fp"
    assert closest_to_fp(rows + [_row("kvquant", 19)], bits, 1, 4096) == "kvquant (3.50 bits): 1 more than fp"
    assert closest_to_fp(rows, bits, 4, 4096) == "-" and closest_to_fp(rows, bits, 1, 8192) == "-"
    assert closest_to_fp(rows, {"kvmix": 4.1}, 1, 4096) == "-"


@from_transformers(5, 21, "transformers' fp8 QuantizedCache")
def test_quantized_cache_memory_counts_what_transformers_holds_and_names_its_refusal():
    """transformers' fp8 QuantizedCache after a 40-token prefill in steps of 16 holds one byte per K/V element and two
    fp32 scales per layer; transformers refuses QuantizedCache for a hybrid model (the tiny Gemma 3), and the row says so."""
    import torch

    from benchmarks.end_to_end.long_context import quantized_cache_memory
    from helpers.tiny_models import tiny_model

    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0))
    llama = tiny_model("llama")
    config = llama.config
    width = config.num_key_value_heads * (config.hidden_size // config.num_attention_heads)
    with torch.inference_mode():
        held = quantized_cache_memory(llama, ids, "fp8", None, 16)
        refused = quantized_cache_memory(tiny_model("gemma3_text"), ids, "fp8", None, 16)
    assert held == {"live_bytes": config.num_hidden_layers * 2 * (40 * width + 4)}
    assert refused == {"refused": "`QuantizedCache` is only supported for models with only full attention layers"}


def test_the_host_benchmark_times_the_cuda_path_of_every_cache_it_names():
    """A run at a tiny size: the kvcal cache decodes on the CUDA path with its launches skipped (past KIVI's 128-token
    residual: the value append and one tensor-core decode launch per layer and step, a key block's append now and
    then) and its load of the prompt's context is timed, and StaticCache and DynamicCache rows give their torch
    operations only."""
    from benchmarks.end_to_end import host

    args = host.parse_args(["--recipes", "kivi", "--batches", "2", "--length", "160", "--new-tokens", "4", "--rounds", "1",
                            "--layers", "1"])
    rows = host.measure(args)["results"]
    assert [r["cache"] for r in rows] == ["StaticCache", "DynamicCache", "kvcal kivi"]
    kivi = rows[-1]
    assert {"append_token_uniform", "decode_tc"} <= set(kivi["launched"]) and 2 <= kivi["launches_per_layer"] < 3
    assert kivi["host_us_per_layer"] > 0 and kivi["host_ms_32_layers"] == round(32 * kivi["host_us_per_layer"] / 1000, 2)
    assert kivi["load_ms_per_layer"] > 0 and 0 <= kivi["load_host_ms_per_layer"] <= kivi["load_ms_per_layer"]
    assert all("host_us_per_layer" not in r and r["torch_ops_per_layer"] > 0 for r in rows[:2])


def test_the_mla_benchmark_decodes_dynamic_cache_and_kvcals_caches_and_counts_their_bytes(tmp_path, monkeypatch):
    """A run at the tiny MLA shape: DynamicCache and each kvcal cache decode after the same prompt, kvcal's on the CPU
    kernel and (--reference) on the torch reference; the bytes are each cache's own (DynamicCache's latent and rotated
    key in fp32 on the CPU: 4 bytes of 96 + 64 channels per token and layer; kvcal's fp16 and quantized), and the
    table's ratios are against DynamicCache's."""
    from benchmarks import common
    from benchmarks.end_to_end import mla

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    mla.main(["--shape", "tiny", "--lengths", "40", "--layers", "2", "--new-tokens", "3", "--rounds", "1",
              "--profile-seqlen", "32", "--recipes", "kivi,kvquant", "--reference"])
    result = json.loads((tmp_path / next(p.name for p in tmp_path.glob("mla_generate_*.json"))).read_text())
    rows = {row["cache"]: row for row in result["results"]}
    assert list(rows) == ["DynamicCache", "kvcal kivi", "kvcal kivi (torch reference)", "kvcal kvquant",
                          "kvcal kvquant (torch reference)"] and all(r["ms_per_step"] > 0 for r in rows.values())
    assert [r["decode_path"] for r in rows.values()] == ["transformers", *["cpu-kernel", "reference"] * 2]
    assert rows["kvcal kivi (torch reference)"]["cache_bytes"] == rows["kvcal kivi"]["cache_bytes"]
    tokens = 40 + 3 - 1  # the prompt and the new tokens but the last, whose step has not stored it
    assert rows["DynamicCache"]["cache_bytes"] == 2 * tokens * (96 + 64) * 4
    assert rows["kvcal kivi"]["cache_bytes"] == 2 * tokens * (96 + 64) * 2  # all within KIVI's fp16 residual
    assert rows["kvcal kvquant"]["cache_bytes"] < rows["kvcal kivi"]["cache_bytes"]
    table = (tmp_path / next(p.name for p in tmp_path.glob("mla_generate_*.md"))).read_text()
    assert "| 40 | kvcal kivi | cpu-kernel |" in table and "| 50.0% |" in table


@SPARSE_LATENTS
@pytest.mark.parametrize("shape, prefix, bytes_per_token", [
    ("tiny-sparse", "mla_sparse_generate_", {"DynamicCache": (96 + 64) * 4 + 80 * 4, "kvcal kivi": (96 + 64) * 2 + 80 * 4,
                                             "kvcal kivi, indexer fp8": (96 + 64) * 2 + 80 + 4}),
    ("tiny-glm5-next", "mla_glm5_next_generate_", {"DynamicCache": 96 * 4 + 33 * 4, "kvcal kivi": 96 * 2 + 33 * 4,
                                                   "kvcal kivi, indexer fp8": 96 * 2 + 33 + 4})])
def test_the_mla_benchmark_at_sparse_attention_counts_the_indexer_keys_and_decodes_the_pick(tmp_path, monkeypatch, shape,
                                                                                            prefix, bytes_per_token):
    """At the tiny DeepSeek-V3.2 shape past its pick of 64 tokens, and at the tiny GLM-5 Next one past its pick (8 pools
    of 4 tokens and the pool not yet complete): both caches hold the indexer's keys (DeepSeek-V3.2's 80 channels, GLM-5
    Next's states of 2 x 16 + 1; fp32 on the CPU, or in kvcal's second row FP8 codes and a 4-byte scale) beside the
    latent and the rotated key (GLM-5 Next's: none), and kvcal's decode steps attend over the pick on the torch
    reference."""
    from benchmarks import common
    from benchmarks.end_to_end import mla

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    mla.main(["--shape", shape, "--lengths", "80", "--layers", "2", "--new-tokens", "3", "--rounds", "1",
              "--profile-seqlen", "32", "--recipes", "kivi"])
    result = json.loads((tmp_path / next(p.name for p in tmp_path.glob(f"{prefix}*.json"))).read_text())
    rows = {row["cache"]: row for row in result["results"]}
    assert [r["decode_path"] for r in rows.values()] == ["transformers", "reference", "reference"]
    assert {name: row["cache_bytes"] for name, row in rows.items()} == {
        name: 2 * (80 + 3 - 1) * per_token for name, per_token in bytes_per_token.items()}


def test_the_speculative_benchmark_times_greedy_and_prompt_lookup_on_each_cache(tmp_path, monkeypatch, tiny_model_dir):
    """A run on a tiny model (no chat template: the request as plain text): greedy generate() and prompt lookup on
    DynamicCache and on kvcal's KIVI-2 cache (there also with later_steps="decode", giving greedy's tokens), greedy
    one forward a new token and its own tokens; a bundle path that does not exist is refused before anything runs
    or is written."""
    from benchmarks import common
    from benchmarks.end_to_end import speculative

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    with pytest.raises(SystemExit) as exit_:
        speculative.main(["--model", str(tiny_model_dir("llama")), "--bundles", str(tmp_path / "none.safetensors")])
    assert exit_.value.code == 2 and not list(tmp_path.iterdir())
    speculative.main(["--model", str(tiny_model_dir("llama")), "--samples", "1", "--passage-tokens", "32",
                      "--new-tokens", "6", "--lookup", "3", "--rounds", "1", "--out", "speculative"])
    rows = json.loads((tmp_path / "speculative.json").read_text())["results"]
    assert [(r["cache"], r["decoding"]) for r in rows] == [("DynamicCache", "greedy"), ("DynamicCache", "lookup")] + [
        ("kvcal kivi2-g32", way) for way in ("greedy", "lookup", "lookup, later_steps=decode")]
    assert all(r["ms_per_token"] > 0 for r in rows) and rows[0]["vs_dynamic_greedy"] == 1.0
    assert all(r["forwards_per_token"] == 1.0 and r["same_as_greedy"] == 1.0 for r in rows if r["decoding"] == "greedy")
    assert rows[-1]["same_as_greedy"] == 1.0
    assert "| kvcal kivi2-g32 | lookup, later_steps=decode |" in (tmp_path / "speculative.md").read_text()


def test_the_short_steps_benchmark_times_both_ways_and_names_the_runtimes(tmp_path, monkeypatch, tiny_model_dir):
    """A run on a tiny model: each step length after each context timed through the kernel and the reference on
    KIVI-2 and DynamicCache, and through the kernel with later_steps="decode", the runtime's way named by the
    backends' limit, which the run leaves as it found it; a step list that is not numbers, or a shape beside a model,
    is refused before anything runs or is written."""
    from benchmarks import common
    from benchmarks.end_to_end import short_steps
    from kvcal.runtime import backends

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    for refused in (["--steps", "4,many"], ["--shape", "tiny"]):  # (--shape beside --model)
        with pytest.raises(SystemExit) as exit_:
            short_steps.main(["--model", str(tiny_model_dir("llama")), *refused])
        assert exit_.value.code == 2 and not list(tmp_path.iterdir())
    monkeypatch.setattr(backends, "CPU_SHORT_STEP_TOKENS", 10)
    short_steps.main(["--model", str(tiny_model_dir("llama")), "--contexts", "20", "--steps", "3,40", "--rounds", "1",
                      "--out", "short_steps"])
    rows = json.loads((tmp_path / "short_steps.json").read_text())["results"]
    assert [(r["cache"], r["context"], r["step"], r["runtime"]) for r in rows] == [
        ("kvcal kivi2-g32", 20, 3, "kernel"), ("kvcal kivi2-g32", 20, 40, "reference")]
    assert all(r["ms_kernel"] > 0 and r["ms_reference"] > 0 and r["ms_dynamic_cache"] > 0 and r["ms_decode_steps"] > 0
               for r in rows)
    assert backends.CPU_SHORT_STEP_TOKENS == 10 and "| kvcal kivi2-g32 | 20 | 40 |" in (tmp_path / "short_steps.md").read_text()


@pytest.mark.slow
def test_the_host_benchmark_compares_two_trees_run_by_run(tmp_path):
    """--baseline-tree with this checkout as the baseline: a round runs both trees' packages in turn and a row gives
    both sides and their ratio; the baseline's runs name its commit."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.end_to_end", "host", "--recipes", "kivi", "--batches", "1",
                           "--length", "160", "--new-tokens", "4", "--rounds", "1", "--layers", "1", "--baseline-tree", str(REPO),
                           "--out", str(tmp_path / "ab")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "ab.json").read_text())
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert result["baseline_commit"] == head and result["settings"]["rounds"] == 1
    (kivi,) = [r for r in result["results"] if r["cache"] == "kvcal kivi"]
    assert kivi["this_launches_per_layer"] == kivi["baseline_launches_per_layer"] and kivi["ratio"] > 0
    assert kivi["this_load_host_ms_per_layer"] >= 0 and kivi["baseline_load_host_ms_per_layer"] >= 0
    assert "| 1 | kvcal kivi |" in (tmp_path / "ab.md").read_text()
