"""benchmarks.end_to_end: what the long-context passkey report names as the recipe closest to fp."""

from benchmarks.end_to_end.long_context import closest_to_fp


def _row(method: str, correct: int, length: int = 4096, keys: int = 1) -> dict:
    return {"method": method, "correct": correct, "samples": 20, "length": length, "keys": keys}


def test_the_closest_recipe_is_the_best_retriever_within_the_bits_bound():
    """kvmix retrieves most but stores 4.1 bits, over the 3.6 bound; of the others mixed retrieves most (a tie goes to
    the fewer bits); a length or variant with no fp row, or no recipe within the bound, names none."""
    rows = [_row("fp", 18), _row("kvmix", 18), _row("kvquant", 15), _row("mixed", 16), _row("kivi", 16), _row("fp", 9, 8192)]
    bits = {"kvmix": 4.1, "kvquant": 3.5, "mixed": 3.0, "kivi": 3.4}
    assert closest_to_fp(rows, bits, 1, 4096) == "mixed (3.00 bits): 2 fewer than fp"
    assert closest_to_fp(rows + [_row("kvquant", 19)], bits, 1, 4096) == "kvquant (3.50 bits): 1 more than fp"
    assert closest_to_fp(rows, bits, 4, 4096) == "-" and closest_to_fp(rows, bits, 1, 8192) == "-"
    assert closest_to_fp(rows, {"kvmix": 4.1}, 1, 4096) == "-"
