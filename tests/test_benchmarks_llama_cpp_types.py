"""benchmarks.llama_cpp_types: llama.cpp's own perplexity under its cache types beside kvcal's simulation of them."""

import math

import pytest
import torch

from benchmarks import llama_cpp_types
from helpers.tiny_models import tiny_model
from kvcal.adapters import adapt
from kvcal.errors import KvcalError
from kvcal.methods import baseline_method


def test_chunks_are_llama_perplexitys_consecutive_windows_with_bos_first_and_a_short_text_is_refused():
    tokens = list(range(100, 150))
    batch = llama_cpp_types.chunks_of(tokens, 16, 3, bos=7)
    assert batch.tolist() == [[7, *range(101, 116)], [7, *range(117, 132)], [7, *range(133, 148)]]
    assert llama_cpp_types.chunks_of(tokens, 16, 3, bos=None)[1, 0] == 116  # a model without BOS keeps its token
    with pytest.raises(KvcalError, match="fewer than 4 chunks of 16; lower --chunks"):
        llama_cpp_types.chunks_of(tokens, 16, 4, bos=7)


def test_kvcal_scores_the_second_half_of_each_chunk_as_llama_perplexity_does():
    """Positions ctx/2 .. ctx-2 predict the next token: ctx/2 - 1 tokens a chunk, from the full forward's logits."""
    model = tiny_model("llama")
    batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model(input_ids=batch, use_cache=False).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[:, 8:15].reshape(-1, logits.shape[-1]), batch[:, 9:].reshape(-1))
    adapter = adapt(model)
    assert llama_cpp_types.kvcal_ppl(model, adapter, batch, None) == pytest.approx(math.exp(float(nll)), rel=1e-5)
    q4_0 = baseline_method("q4_0", adapter.head_dims, adapter.windows)
    assert llama_cpp_types.kvcal_ppl(model, adapter, batch, q4_0) != pytest.approx(math.exp(float(nll)), rel=1e-6)


@pytest.mark.parametrize("line", [
    "[1]12.3456,[2]13.0001,\nFinal estimate: PPL = 13.0001 +/- 0.41234\n",  # llama.cpp
    "[1]12.3456,[2]13.0001,\nFinal estimate: PPL over 2 chunks for n_ctx=512 = 13.0001 +/- 0.41234\n",  # ik_llama.cpp
])
def test_the_final_estimate_line_is_what_either_llama_perplexity_prints(line):
    found = llama_cpp_types.FINAL_ESTIMATE.search(line)
    assert (float(found.group(1)), float(found.group(2))) == (13.0001, 0.41234)


def test_an_ik_llama_cpp_setting_runs_with_the_arguments_kvcal_plan_prints_and_its_rotation():
    spec = "q8_0/q4_0;k_first=f16,2;v_last=q8_0,1"
    assert " ".join(llama_cpp_types.cache_arguments("ik_llama.cpp", spec)) == \
        "-ctk q8_0 -ctv q4_0 -ctk-first f16,2 -ctv-last q8_0,1 -khad -vhad"
    assert llama_cpp_types.cache_arguments("llama.cpp", "q8_0/q4_0") == ["-ctk", "q8_0", "-ctv", "q4_0"]
    assert llama_cpp_types.cache_arguments("ik_llama.cpp", "f16") == ["-ctk", "f16", "-ctv", "f16"]
    adapter = adapt(tiny_model("llama"))
    ik = llama_cpp_types.kvcal_method("ik_llama.cpp", "q4_0", adapter)  # -khad: ik_llama.cpp's rotation, not llama.cpp's
    assert {layer.key_codec.hadamard for layer in ik.layers} == {"ik_llama.cpp"}
    assert llama_cpp_types.kvcal_method("llama.cpp", "q4_0", adapter).layers[0].key_codec.hadamard == "llama.cpp"
    first = llama_cpp_types.kvcal_method("ik_llama.cpp", spec, adapter).layers[0].key_codec
    assert first.bits == 16  # the first two layers' keys stay f16


@pytest.mark.parametrize("arguments, message", [
    ([], "no llama-perplexity there; pass the bin folder of a llama.cpp build"),
    (["--types", "q4_0", "q3_k"], "--types q3_k: not a llama.cpp cache type"),
    (["--types", "q4_0;k_first=q8_0,2"], "--types q4_0;k_first=q8_0,2: not a llama.cpp cache type"),
    (["--engine", "ik_llama.cpp", "--types", "q4_0;skip=1"], "'q4_0;skip=1' is not an ik_llama.cpp setting"),
    (["--engine", "ik_llama.cpp", "--types", "q4_0;k_first=q8_0,2;k_first=f16,1"], "at most once each"),
    (["--chunks", "0"], "--chunks at least 1"),
])
def test_bad_input_is_refused_in_one_line_with_exit_2_and_nothing_written(tmp_path, capsys, arguments, message):
    binaries = tmp_path / "bin"
    binaries.mkdir()
    if arguments:  # the binaries' check passes, so the next one speaks
        for name in llama_cpp_types.BINARIES:
            (binaries / name).touch()
    with pytest.raises(SystemExit) as exited:
        llama_cpp_types.main(["--llama-cpp", str(binaries), "--name", str(tmp_path / "out"), *arguments])
    assert exited.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
