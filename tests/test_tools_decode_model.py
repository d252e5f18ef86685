"""tools/decode_model.py: the calibrated model of the tensor-core decode kernel."""

import math

import pytest

from tools import decode_model as dm


def points_of(model: dm.Model, counts) -> list[dm.Point]:
    return [dm.Point(f"v{i}", n, w, model.slots(n, w)) for i, (n, w) in enumerate(counts)]


def test_the_fit_recovers_the_constants_that_made_the_measurements():
    truth = dm.Model(0.55, 29.0)
    points = points_of(truth, [(16, 2.3), (31, 6.1), (40, 10.4), (146, 34.8)])
    fitted = dm.fit(points)
    assert math.isclose(fitted.per_instruction, 0.55, rel_tol=1e-9) and math.isclose(fitted.constant, 29.0, rel_tol=1e-9)
    assert all(abs(e) < 1e-9 for e in dm.leave_one_out(points).values())


def test_the_line_reading_pays_its_constant_per_line_and_its_fit_recovers_it():
    truth = dm.Model(0.5, 14.0, "line")
    assert truth.slots(10.0, 1.0, lines=2.5) == 0.5 * 10 + 4 * 1 + 14.0 * 2.5
    counts = [(16, 2.3, 2.0), (31, 6.1, 2.0), (40, 10.4, 2.5), (146, 34.8, 2.0)]
    points = [dm.Point(f"v{i}", n, w, truth.slots(n, w, lines), lines) for i, (n, w, lines) in enumerate(counts)]
    fitted = dm.fit(points, "line")
    assert fitted.reading == "line" and math.isclose(fitted.constant, 14.0, rel_tol=1e-9)
    assert all(abs(e) < 1e-9 for e in dm.leave_one_out(points, "line").values())
    # the per-token reading cannot follow the 2.5-line variant exactly
    assert max(abs(e) for e in dm.leave_one_out(points, "token").values()) > 1e-3


def test_shared_wavefronts_cost_one_clock_of_every_scheduler_and_are_not_fitted():
    model = dm.Model(0.0, 0.0)
    assert model.slots(100.0, 10.0) == 40.0  # 4 schedulers x 10 clocks


def test_leaving_a_variant_out_predicts_it_from_the_others():
    points = points_of(dm.Model(0.5, 30.0), [(16, 2.3), (31, 6.1), (40, 10.4)])
    odd = dm.Point("odd", 146.0, 34.8, 2 * dm.Model(0.5, 30.0).slots(146.0, 34.8))  # took twice what the model says
    loo = dm.leave_one_out(points + [odd])
    assert math.isclose(loo["odd"], -0.5, rel_tol=1e-9)  # the others' model predicts half its time
    assert all(abs(e) > 1e-3 for name, e in loo.items() if name != "odd")  # and the outlier pulls every other fit


def test_the_prediction_is_the_longer_of_compute_and_memory():
    model = dm.Model(1.0, 0.0)
    slots_per_s, tokens = 1e12, 1000
    compute = dm.predicted_seconds(model, 100.0, 0.0, 1.0, 1e12, tokens, slots_per_s)
    assert math.isclose(compute, 100.0 * tokens / slots_per_s)
    memory = dm.predicted_seconds(model, 100.0, 0.0, 1e6, 1e9, tokens, slots_per_s)
    assert math.isclose(memory, 1e-3)
    assert math.isclose(dm.measured_slots(compute, tokens, slots_per_s), 100.0)


def test_two_constants_need_two_measurements():
    with pytest.raises(ValueError, match="two measured variants"):
        dm.fit([dm.Point("one", 16.0, 2.0, 44.0)])
