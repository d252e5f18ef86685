"""How a cache keeps sparse layers' indexer keys: as computed, or FP8 codes with a scale per 128 channels."""

import pytest
import torch

from kvcal.indexer_keys import FP8, StoredRows, round_trip, token_bytes


def _rows(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_fp8_rows_come_back_within_an_e4m3_step_of_their_values():
    """Each 128 channels of a token have their own scale, the power of two at or above their largest magnitude / 448
    (DeepSeek's and vLLM's ue8m0): a value comes back within 1/16 of itself, or within 2^-10 of the scale below
    e4m3's smallest normal (2^-6 of it), even beside a channel 1000 times the others; zero as zero."""
    rows = _rows(2, 5, 257)
    rows[..., 3] *= 1000  # (in the first group of 128)
    rows[0, 0, 130] = 0.0
    back = round_trip("fp8", rows)
    assert back.dtype == rows.dtype and back.shape == rows.shape
    largest = torch.nn.functional.pad(rows, (0, 127)).unflatten(-1, (-1, 128)).abs().amax(-1)
    scales = torch.exp2(torch.ceil(torch.log2(largest / 448)))
    assert torch.equal(StoredRows.encoded("fp8", rows).parts[1], scales)
    per_channel = scales.repeat_interleave(128, -1)[..., :257]
    assert bool(((back - rows).abs() <= torch.maximum(rows.abs() / 16, per_channel * 2**-10)).all())
    assert float(back[0, 0, 130]) == 0.0


def test_a_flag_channel_of_its_own_group_stays_exact():
    """GLM-5 Next's packed states (128 key channels, 128 gate scores, a real-token flag): the flag, alone in its group,
    comes back 1.0 or 0.0 exactly."""
    rows = _rows(1, 6, 257)
    rows[..., -1] = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    assert torch.equal(round_trip("fp8", rows)[..., -1], rows[..., -1])


def test_fp8_rows_take_a_byte_a_channel_and_four_a_scale():
    stored = StoredRows.encoded("fp8", _rows(3, 7, 257))
    assert stored.parts[0].dtype == FP8 and stored.parts[1].dtype == torch.float32
    assert stored.nbytes == 3 * 7 * token_bytes("fp8", 257, 2) == 3 * 7 * (257 + 3 * 4)
    assert token_bytes("fp8", 128, 2) == 132 and token_bytes("model", 128, 2) == 256
    kept = StoredRows.encoded("model", _rows(3, 7, 128).to(torch.bfloat16))
    assert kept.nbytes == 3 * 7 * token_bytes("model", 128, 2)


@pytest.mark.parametrize("format_name", ["model", "fp8"])
def test_rows_appended_taken_back_and_reordered_decode_as_rows_stored_so(format_name):
    """A row is encoded on its own: steps appended give the rows of the whole stored at once; the first tokens and
    reordered sequences give those rows' and sequences'."""
    rows = _rows(3, 9, 96).to(torch.bfloat16)
    whole = StoredRows.encoded(format_name, rows)
    steps = StoredRows.encoded(format_name, rows[:, :4]).appended(StoredRows.encoded(format_name, rows[:, 4:]))
    assert torch.equal(steps.decoded(), whole.decoded())
    assert torch.equal(whole.first(5).decoded(), whole.decoded()[:, :5])
    order = torch.tensor([2, 0, 0])
    assert torch.equal(whole.sequences(order).decoded(), whole.decoded()[order])
    assert whole.decoded().dtype == torch.bfloat16
    assert format_name == "fp8" or whole.decoded() is rows  # (kept as computed: handed back as is)


def test_a_group_holding_a_nan_or_an_infinity_comes_back_not_finite_and_an_unknown_format_is_refused():
    """A NaN or infinite key (a model gone wrong) is not rounded into a finite one: its group of 128 channels comes back
    not finite, the next group as stored; a format other than model and fp8 is refused, not read as either."""
    rows = _rows(1, 3, 256)
    rows[0, 0, 5], rows[0, 1, 7] = float("nan"), float("inf")
    back = round_trip("fp8", rows)
    for token in (0, 1):
        assert not bool(back[0, token, :128].isfinite().any()) and bool(back[0, token, 128:].isfinite().all())
    assert bool(back[0, 2].isfinite().all())
    for call in (lambda: token_bytes("int4", 128, 2), lambda: StoredRows.encoded("int4", rows)):
        with pytest.raises(ValueError, match="indexer keys format 'int4' is not one of model, fp8"):
            call()
