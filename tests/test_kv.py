"""kvcal.kv: the segment policy the simulation and the runtime share."""

import torch

from kvcal.kv import SegmentPolicy


def test_the_segment_policy_counts_an_int_as_it_counts_a_tensor():
    policies = [SegmentPolicy(sink=4, residual=128, key_block=32), SegmentPolicy(window=64, sink=5),
                SegmentPolicy(residual=8, key_block=4), SegmentPolicy(key_block=32, sink=1), SegmentPolicy()]
    for policy in policies:
        for keys in (True, False):
            assert [policy.fp16_recent(n, keys) for n in range(600)] == policy.fp16_recent(torch.arange(600), keys).tolist()
