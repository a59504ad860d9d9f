"""The engine's step timer (appliance/engine/stats.py): sections add up, nested entries count once."""
from appliance.engine import stats


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_sections_accumulate_and_nesting_counts_once(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(stats.time, "perf_counter", clock)
    timer = stats.StepTimer()
    with timer.gemm():
        clock.now += 2.0
    with timer.attn():
        clock.now += 0.5
        with timer.attn():            # entered again while open: not counted twice
            clock.now += 0.25
    with timer.gemm():
        clock.now += 1.0
    assert timer.gemm_s == 3.0
    assert timer.attn_s == 0.75


def test_a_section_left_by_an_exception_still_counts(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(stats.time, "perf_counter", clock)
    timer = stats.StepTimer()
    try:
        with timer.gemm():
            clock.now += 1.5
            raise RuntimeError("a kernel failed")
    except RuntimeError:
        pass
    with timer.gemm():
        clock.now += 0.5
    assert timer.gemm_s == 2.0


def test_decode_rest_is_what_gemm_and_attention_leave():
    d = stats.DecodeStats(batch=1, n_context=10, total_s=0.040, gemm_s=0.030, attn_s=0.008)
    assert abs(d.rest_s - 0.002) < 1e-12
    assert "rest_ms=2.00" in d.log_line()
    assert stats.DecodeStats(batch=1, n_context=1, total_s=0.01, gemm_s=0.02).rest_s == 0.0
