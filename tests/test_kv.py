"""kvcal.kv: the segment policy the simulation and the runtime share."""

import torch

from kvcal.kv import SegmentPolicy, softmax_with_sinks


def test_the_segment_policy_counts_an_int_as_it_counts_a_tensor():
    policies = [SegmentPolicy(sink=4, residual=128, key_block=32), SegmentPolicy(window=64, sink=5),
                SegmentPolicy(residual=8, key_block=4), SegmentPolicy(key_block=32, sink=1), SegmentPolicy()]
    for policy in policies:
        for keys in (True, False):
            assert [policy.fp16_recent(n, keys) for n in range(600)] == policy.fp16_recent(torch.arange(600), keys).tolist()


def test_a_row_of_scores_that_sees_nothing_weighs_no_value():
    """A query that sees no key (an indexer picked none for it) gets weights of zero, as SDPA gives it, not NaN; with
    a sink, the sink takes all its weight; the other rows are softmaxes."""
    scores = torch.tensor([[0.5, -1.0, 2.0], [float("-inf")] * 3, [float("-inf"), 0.0, float("-inf")]])
    probs = softmax_with_sinks(scores, None)
    assert torch.equal(probs[1], torch.zeros(3)) and torch.equal(probs[2], torch.tensor([0.0, 1.0, 0.0]))
    torch.testing.assert_close(probs[0], torch.softmax(scores[0], -1))
    assert torch.equal(softmax_with_sinks(scores, torch.tensor(0.0))[1], torch.zeros(3))
