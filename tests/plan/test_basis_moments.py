"""The basis's activation line when the peak's moment moves between the two traced batches (issue 37 point 1).

Numbers of a real trace (tiny Mixtral, fp32, ``probes.estimate.window_reports``): at micro-batch 2 the backward peaks
mid-backward (49,280 gradient bytes live, 172,848 of activations), at 4 at its start (no gradients, 550,480). A line
through those two moments gave -15,968 bytes of activations at micro-batch 1, a negative activation-offload cost,
and a plan that ended in ``math domain error``.
"""

from trainfit.plan.basis import basis_from_reports
from trainfit.probes.estimate import WindowReport

STATE = dict(params_bytes=255680, grads_bytes=255616, optimizer_bytes=511316)


def _report(batch, forward, backward):
    phases = {"forward": dict(zip(("peak", "activations", "temporaries", "grads"), forward)),
              "backward": dict(zip(("peak", "activations", "temporaries", "grads"), backward)),
              "optimizer": {"peak": 1155028, "activations": 816, "temporaries": 131600, "grads": 255616}}
    return WindowReport(method="estimated", precision="fp32", checkpointing="none", batch=batch, n_params=63904,
                        phases=phases, **STATE)


R2 = _report(2, (1060372, 276404, 16972, 0), (1100536, 172848, 111412, 49280))
R4 = _report(4, (1350836, 550996, 32844, 0), (1383032, 550480, 65556, 0))


def test_activations_stay_non_negative_and_the_peaks_exact_when_the_moment_moves():
    b = basis_from_reports(R2, R4, model_flops_per_sample=1.0, hardware_flops_per_sample=1.0, n_blocks=2)
    act = lambda n: b.act_fixed_bytes + b.act_per_sample_bytes * n  # noqa: E731
    temp = lambda n: b.temp_fixed_bytes + b.temp_per_sample_bytes * n  # noqa: E731
    assert act(1) >= 0, act(1)
    # the forward/backward peak of each report, by hand: peak - params - grads live at it - optimizer state
    assert act(2) + temp(2) == 1100536 - 255680 - 49280 - 511316
    assert act(4) + temp(4) == 1383032 - 255680 - 0 - 511316
    assert act(4) == 550996  # the most the window holds at 4 (end of forward), a consistent moment with 2's 276404
    assert act(2) == 276404


def test_a_line_through_one_moment_is_unchanged():
    r2 = _report(2, (900000, 200000, 10000, 0), (950000, 199000, 40000, 0))
    r4 = _report(4, (1100000, 400000, 20000, 0), (1150000, 398000, 80000, 0))
    b = basis_from_reports(r2, r4, model_flops_per_sample=1.0, hardware_flops_per_sample=1.0, n_blocks=2)
    assert b.act_per_sample_bytes == (398000 - 199000) / 2  # the activations live at the backward peak
    assert b.act_fixed_bytes == 398000 - 4 * b.act_per_sample_bytes
