import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.packing import (OUTLIER_TILE_TOKENS, check_outlier_head_dim, codes_per_word, layout_for, pack, packed_row_bits,
                           packed_words, unpack)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("length", [1, 7, 10, 11, 31, 32, 33, 100, 129])
def test_lsb_round_trip_for_every_width_and_ragged_lengths(bits, length):
    codes = torch.randint(0, 2**bits, (3, length), generator=torch.Generator().manual_seed(length))
    words = pack(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (3, packed_words(length, bits))
    assert torch.equal(unpack(words, bits, length), codes)


def test_lsb_bit_order_is_least_significant_first():
    assert pack(torch.tensor([1, 0, 0, 0, 0, 0, 0, 2]), 4).item() == 1 + (2 << 28)
    assert pack(torch.tensor([3] * 16), 2).item() == -1  # all 32 bits set, stored as int32
    assert pack(torch.tensor([5, 1]), 3).item() == 5 + (1 << 3)
    assert pack(torch.tensor([255, 0, 1, 128]), 8).item() == 255 + (1 << 16) - 2**31  # code 3's top bit is the sign
    assert codes_per_word(3) == 10 and codes_per_word(1) == 32 and codes_per_word(2.0) == 16  # recipes may say 2.0
    assert codes_per_word(8) == 4 and layout_for(8) == "lsb"


@pytest.mark.parametrize("length", [1, 10, 11, 12, 22, 23, 50])
def test_kvmix_3bit_layout_packs_eleven_codes_and_clamps_the_eleventh(length):
    codes = torch.randint(0, 8, (2, length), generator=torch.Generator().manual_seed(length))
    words = pack(codes, 3, "kvmix10x3+1x2")
    assert words.shape == (2, -(-length // 11))
    expected = codes.clone()
    expected[:, 10::11] = expected[:, 10::11].clamp(max=3)
    assert torch.equal(unpack(words, 3, length, "kvmix10x3+1x2"), expected)
    assert pack(torch.tensor([0] * 10 + [1]), 3, "kvmix10x3+1x2").item() == 1 << 30


def test_bad_widths_layouts_and_codes_are_refused():
    with pytest.raises(KvcalError, match="3-bit codes"):
        pack(torch.zeros(4, dtype=torch.long), 2, "kvmix10x3+1x2")
    with pytest.raises(KvcalError, match="planes3 holds 3-bit codes"):
        pack(torch.zeros(4, dtype=torch.long), 4, "planes3")
    with pytest.raises(KvcalError, match="unknown packing layout"):
        pack(torch.zeros(4, dtype=torch.long), 2, "msb")
    with pytest.raises(KvcalError, match="planes6 holds 6-bit codes"):
        pack(torch.zeros(4, dtype=torch.long), 5, "planes6")
    with pytest.raises(KvcalError, match="widths 1-4 and 8 are"):
        pack(torch.zeros(4, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="outside"):
        pack(torch.tensor([4]), 2)


@pytest.mark.parametrize("length", [1, 19, 20, 21, 48, 100])
def test_ternary_layout_packs_twenty_base3_codes_per_word(length):
    codes = torch.randint(0, 3, (2, length), generator=torch.Generator().manual_seed(length))
    words = pack(codes, 1.5, "ternary20")
    assert words.shape == (2, -(-length // 20)) and codes_per_word(1.5, "ternary20") == 20
    assert torch.equal(unpack(words, 1.5, length, "ternary20"), codes)
    assert pack(torch.tensor([2] * 20), 1.5, "ternary20").item() == 3**20 - 1 - 2**32  # the top of the uint32 range


@pytest.mark.parametrize("length", [1, 16, 31, 32, 33, 64, 100, 192])
def test_planes3_stores_3_bit_codes_in_exactly_3_bits_per_code(length):
    codes = torch.randint(0, 8, (2, length), generator=torch.Generator().manual_seed(length))
    words = pack(codes, 3, "planes3")
    assert words.shape == (2, 3 * -(-length // 32))
    assert torch.equal(unpack(words, 3, length, "planes3"), codes)
    assert layout_for(3) == "planes3" and packed_row_bits(192, 3) == 192 * 3  # "lsb" took 20 words: 640 bits


@pytest.mark.parametrize("bits", [5, 6, 7])
@pytest.mark.parametrize("length", [1, 8, 31, 32, 33, 64, 100])
def test_planes_store_5_to_7_bit_codes_in_exactly_their_bits(bits, length):
    codes = torch.randint(0, 2**bits, (2, length), generator=torch.Generator().manual_seed(length))
    words = pack(codes, bits, f"planes{bits}")
    assert words.shape == (2, bits * -(-length // 32))
    assert torch.equal(unpack(words, bits, length, f"planes{bits}"), codes)
    assert layout_for(bits) == f"planes{bits}" and packed_row_bits(64, bits) == 64 * bits


def test_planes_bit_order_nibble_plane_then_narrower_planes():
    code = lambda i, value, bits: pack(torch.tensor([0] * i + [value] + [0] * (31 - i)), bits, f"planes{bits}").tolist()
    assert code(9, 0b10110, 5) == [0, 6 << 4, 0, 0, 1 << 9]  # low nibble of code 9 in word 1 at bit 4, bit 4 in word 4
    assert code(20, 0b111001, 6) == [0, 0, 9 << 16, 0, 0, 3 << 8]  # code 20: nibble in word 2, 2-bit field in word 5
    top = [w & 0xFFFFFFFF for w in code(31, 127, 7)]  # uint32 patterns stored as int32
    assert top == [0, 0, 0, 15 << 28, 0, 3 << 30, 1 << 31]  # code 31 of 7 bits: the top field of each plane


def test_planes3_bit_order_low_planes_then_high_plane():
    code = lambda i, value: pack(torch.tensor([0] * i + [value] + [0] * (31 - i)), 3, "planes3").tolist()
    assert code(0, 7) == [3, 0, 1]  # low bits of code 0 at bit 0 of word 0, its high bit at bit 0 of word 2
    assert code(17, 6) == [0, 2 << 2, 1 << 17]  # code 17: low bits at bit 2 of word 1, high bit at bit 17 of word 2
    assert code(31, 7) == [0, (3 << 30) - 2**32, -(1 << 31)]  # the top bits: uint32 patterns as int32


def test_outlier_positions_must_fit_16_bits():
    check_outlier_head_dim(2**16 // OUTLIER_TILE_TOKENS)
    with pytest.raises(KvcalError, match="head_dim 2048 is too large.*without outliers"):
        check_outlier_head_dim(2048)
