"""kvcal.generation's prompts: the passkey and multi-key retrieval prompts."""

import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.generation import DOORS, multikey_prompt


def test_a_multikey_prompt_states_each_key_once_in_depth_order_and_asks_the_chosen_ones(tiny_tokenizer):
    filler = torch.arange(3, 403)
    context, questions = multikey_prompt(tiny_tokenizer, filler, 300, [11111, 22222, 33333], [0.9, 0.1, 0.5], [2, 0])
    text = tiny_tokenizer.decode(context)
    positions = [text.index(f"pass key of the {DOORS[i]} door is {key}") for i, key in ((0, 11111), (1, 22222), (2, 33333))]
    assert positions[1] < positions[2] < positions[0]  # depths 0.1, 0.5, 0.9
    assert all(text.count(str(key)) == 1 for key in (11111, 22222, 33333))
    for question, i in zip(questions, (2, 0)):
        assert tiny_tokenizer.decode(question).strip().startswith(f"What is the pass key of the {DOORS[i]} door?")
    assert len(context) + max(map(len, questions)) == 300
    with pytest.raises(KvcalError, match="filler tokens"):
        multikey_prompt(tiny_tokenizer, filler[:10], 300, [11111, 22222], [0.2, 0.4], [0])
