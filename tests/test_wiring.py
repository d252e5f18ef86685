"""kvcal.wiring: what the attention masks transformers builds for the wired model say about each step's tokens."""

import pytest
import torch

from kvcal.wiring import real_tokens


@pytest.mark.parametrize("window", [None, 3])
def test_padding_is_told_apart_on_the_masks_of_every_torch(window):
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    padding = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]]).bool()
    pattern = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    for past in (0, 3, 7):
        m, n = padding.shape[1] - past, padding.shape[1]
        mask = sdpa_mask(batch_size=3, q_length=m, kv_length=n, q_offset=past, mask_function=pattern,
                         attention_mask=padding, allow_is_causal_skip=False)
        for variant in (mask, mask | (~mask).all(-1, keepdim=True)):  # torch >= 2.5, torch < 2.5
            assert torch.equal(real_tokens(variant, 3, m, "cpu"), padding[:, past:])
            assert torch.equal(real_tokens(torch.where(variant, 0.0, float("-inf")), 3, m, "cpu"), padding[:, past:])
