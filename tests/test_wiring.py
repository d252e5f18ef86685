"""kvcal.wiring: what the attention masks transformers builds for the wired model say about each step's tokens."""

import pytest
import torch

from helpers.tiny_models import MINIMAX_M3_BLOCK, tiny_config
from kvcal.errors import KvcalError
from kvcal.wiring import chosen_columns, own_tokens_ahead, real_tokens


@pytest.mark.parametrize("window", [None, 3])
def test_padding_is_told_apart_on_the_masks_of_every_torch(window):
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    padding = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]]).bool()
    pattern = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    for past in (0, 3, 7):
        m, n = padding.shape[1] - past, padding.shape[1]
        mask = sdpa_mask(batch_size=3, q_length=m, kv_length=n, q_offset=past, mask_function=pattern,
                         attention_mask=padding, allow_is_causal_skip=False)
        for variant, padding_sees_all in ((mask, False), (mask | (~mask).all(-1, keepdim=True), True)):  # torch >= 2.5, < 2.5
            for form in (variant, torch.where(variant, 0.0, float("-inf"))):  # boolean, additive
                assert torch.equal(real_tokens(form, 3, m, "cpu", padding_sees_all), padding[:, past:])


def test_an_images_tokens_are_told_apart_from_padding_and_seen_ahead_as_gemma3s_mask_says():
    """Gemma 3's mask lets an image's tokens see each other both ways: they are real tokens, and own_tokens_ahead says
    which later tokens of the step each sees (none in a causal step); where padding rows see every column (torch <
    2.5), an image's tokens cannot be told from padding and are refused."""
    from transformers.masking_utils import causal_mask_function, or_masks, sdpa_mask

    padding = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]).bool()
    blocks = torch.tensor([[-1, -1, -1, 0, 0, 0, -1, -1], [-1, 0, 0, -1, -1, -1, -1, -1]])  # an image a row

    def same_image(batch_idx, head_idx, q_idx, kv_idx):
        return (blocks[batch_idx, q_idx] >= 0) & (blocks[batch_idx, q_idx] == blocks[batch_idx, kv_idx])

    causal = sdpa_mask(batch_size=2, q_length=8, kv_length=8, q_offset=0, mask_function=causal_mask_function,
                       attention_mask=padding, allow_is_causal_skip=False)
    images = sdpa_mask(batch_size=2, q_length=8, kv_length=8, q_offset=0, mask_function=or_masks(causal_mask_function, same_image),
                       attention_mask=padding, allow_is_causal_skip=False)
    assert not torch.equal(images, causal)
    valid = real_tokens(images, 2, 8, "cpu", padding_sees_all=False)
    assert torch.equal(valid, padding)
    assert own_tokens_ahead(causal, valid, padding_sees_all=False) is None
    ahead = own_tokens_ahead(images, valid, padding_sees_all=False)
    expected = torch.zeros(2, 8, 8, dtype=torch.bool)
    expected[0, 3, 4:6] = expected[0, 4, 5] = expected[1, 1, 2] = True
    assert torch.equal(ahead, expected)
    with pytest.raises(KvcalError, match="needs torch >= 2.5"):
        own_tokens_ahead(images | (~images).all(-1, keepdim=True), valid, padding_sees_all=True)


def test_the_key_blocks_an_indexer_picked_are_the_columns_minimax_m3s_own_mask_keeps():
    """MiniMax-M3's `block_indices` (per KV head, the blocks of 4 keys each query attends; -1 where it picked fewer)
    are the columns its own eager/SDPA mask keeps (the indexer's build_block_mask, one group per KV head), the last
    block cut at the columns there are; where it picked every block there is, None (every column it sees)."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer

    config = tiny_config("minimax_m3_vl_text")
    indexer = MiniMaxM3VLIndexer(config, 0)
    columns, queries = 18, 3  # 5 blocks, the last of 2 columns
    blocks = torch.tensor([[[[4, 0], [2, -1], [1, 3]], [[0, -1], [4, 3], [2, 1]]]])  # (batch, KV heads, queries, k)
    positions = torch.arange(columns - queries, columns)[None]
    theirs = indexer.build_block_mask(blocks, None, columns, torch.float32, "cpu", positions) == 0
    ours = chosen_columns({"block_indices": blocks}, columns, MINIMAX_M3_BLOCK)
    causal = torch.arange(columns)[None, :] <= positions[0, :, None]
    heads = config.num_attention_heads // blocks.shape[1]
    assert ours.shape == (1, 2, queries, columns)
    assert torch.equal(theirs, (ours & causal).repeat_interleave(heads, 1))
    every = torch.arange(5).expand(1, 2, queries, 5)
    assert chosen_columns({"block_indices": every}, columns, MINIMAX_M3_BLOCK) is None
    assert chosen_columns({}, columns, MINIMAX_M3_BLOCK) is None
