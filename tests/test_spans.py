import torch

from kvcal.kv import window_dropped
from kvcal.spans import AttentionSpan, attention_span, call_mismatch, recorded_spans


def test_a_sliding_window_sees_its_last_tokens_and_a_chunk_its_own_chunks():
    positions = torch.arange(10)
    sliding, chunked = AttentionSpan(4), AttentionSpan(4, chunked=True)
    assert sliding.first_seen(9) == 6 and chunked.first_seen(9) == 8 and chunked.first_seen(7) == 4
    assert torch.equal(sliding.sees(positions, positions).sum(1), torch.tensor([1, 2, 3, 4, 4, 4, 4, 4, 4, 4]))
    assert torch.equal(chunked.sees(positions, positions).sum(1), torch.tensor([1, 2, 3, 4, 1, 2, 3, 4, 1, 2]))
    assert not chunked.sees(positions, positions)[5, 3] and chunked.sees(positions, positions)[5, 4]


def test_spans_come_from_a_window_or_a_chunk_and_from_what_artifacts_record():
    assert attention_span(8, None) == AttentionSpan(8) and attention_span(None, 8) == AttentionSpan(8, chunked=True)
    assert attention_span(None, None) is None
    assert recorded_spans({"windows": [None, 16], "chunks": [8, None]}, 2) == [AttentionSpan(8, True), AttentionSpan(16)]
    assert recorded_spans({}, 2) == [None, None]  # profiles of models without either


def test_a_chunked_layer_drops_each_chunk_once_the_next_begins():
    """At 13 tokens the next query (position 13) is in the chunk from 8: of the 8 before it the 2 sinks and one whole
    block of 4 go; at 16 (a new chunk) all 16 with blocks of 1. A sliding window of 8 keeps the last 7 of 13: 6 go."""
    assert window_dropped(13, 2, 13, 4, AttentionSpan(8, chunked=True)) == 2 + 4
    assert window_dropped(16, 2, 16, 1, AttentionSpan(8, chunked=True)) == 16
    assert window_dropped(13, 2, 13, 4, AttentionSpan(8)) == 2 + 4
    assert window_dropped(13, 2, 13, 1, AttentionSpan(8)) == 6


def test_an_attention_call_must_name_its_layers_sliding_window_and_none_for_chunks():
    assert call_mismatch(8, AttentionSpan(8)) is None and call_mismatch(None, AttentionSpan(8, chunked=True)) is None
    assert call_mismatch(None, None) is None
    assert call_mismatch(4, AttentionSpan(8)) == "attends with a sliding window of 4 tokens but its config gives it a " \
                                                 "sliding window of 8 tokens"
    assert call_mismatch(8, None) == "attends with a sliding window of 8 tokens but its config gives it neither"
