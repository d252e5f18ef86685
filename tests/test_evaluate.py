import math

import pytest
import torch

from helpers.tiny_models import GLM5_NEXT, tiny_model
from kvcal.adapters import adapt
from kvcal.methods import baseline_method
from kvcal.errors import KvcalError
from kvcal.evaluate import consecutive_windows, evaluate_ppl


def test_windows_are_consecutive_and_too_little_text_is_an_error():
    ids = torch.arange(1000)
    windows = consecutive_windows(ids, 100, 4)
    assert torch.equal(windows.flatten(), ids[:400])
    with pytest.raises(KvcalError, match="has only 1000"):
        consecutive_windows(ids, 512, 2)


def test_fp_perplexity_is_the_exponent_of_the_mean_token_loss():
    model = tiny_model("qwen2")
    windows = torch.randint(0, 512, (3, 20), generator=torch.Generator().manual_seed(0))
    results = evaluate_ppl(model, adapt(model), windows, [baseline_method("int4", [16] * 2), baseline_method("int1", [16] * 2)])
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss for w in windows]
    assert results[0].method == "fp"
    assert math.isclose(results[0].ppl, math.exp(sum(losses) / 3), rel_tol=1e-5)
    int4, int1 = results[1:]
    assert int4.effective_bits == 4 + 32 / 32  # groups of 64 cover all 32 channels: one scale and zero per token
    assert int1.effective_bits == 2.0 and int4.ppl != results[0].ppl != int1.ppl


@pytest.mark.parametrize("model_type", GLM5_NEXT)
def test_a_model_storing_no_key_reports_no_key_bits(model_type):
    """GLM-5 Next's MLA has no RoPE: a token caches its latent alone, so a method's K bits are none, where its V bits
    and the indexer's states (fp32 here, 33 channels) are counted; KIVI's fp16 residual longer than the windows keeps
    the model's own perplexity, its pick applied."""
    model = tiny_model(model_type)
    adapter = adapt(model)
    windows = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    methods = [baseline_method(spec, adapter.head_dims, adapter.windows, adapter.decoder_kind, adapter.value_dims,
                               adapter.latent) for spec in ("kivi4-g16-r256", "int4")]
    fp, kivi, int4 = evaluate_ppl(model, adapter, windows, methods)
    assert kivi.key_bits is None and int4.key_bits is None and kivi.index_bits == int4.index_bits == 32.0
    assert int4.value_bits == 4 + 2 * 32 / 96  # (an fp16 scale and zero per group of 64 of the latent's 96 channels)
    assert kivi.ppl == pytest.approx(fp.ppl, rel=1e-5) and int4.ppl != fp.ppl


@pytest.mark.parametrize("model_type", GLM5_NEXT)
def test_queries_an_indexer_picks_nothing_for_attend_to_nothing(model_type):
    """GLM-5 Next without its tail pool (index_kpool_always_select_tail False): a sequence's first 3 tokens see no
    complete pool of 4, their pick is empty, and SDPA gives them no attention output; the simulation does the same, so
    KIVI's fp16 residual longer than the windows keeps the model's own perplexity (not NaN)."""
    model = tiny_model(model_type, index_kpool_always_select_tail=False)
    adapter = adapt(model)
    windows = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(5))
    kivi = baseline_method("kivi4-g16-r256", adapter.head_dims, adapter.windows, adapter.decoder_kind,
                           adapter.value_dims, adapter.latent)
    fp, ours = evaluate_ppl(model, adapter, windows, [kivi])
    assert ours.ppl == pytest.approx(fp.ppl, rel=1e-5)
