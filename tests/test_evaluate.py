import math

import pytest
import torch

from helpers.tiny_models import tiny_model
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
