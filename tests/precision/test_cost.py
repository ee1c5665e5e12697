import torch

from automp.precision import cost


def test_embedding_seed_case_huge_table_stays_fp32():
    # V x D table, N looked-up rows: casting the table (V*D*6 bytes) dwarfs what the lookup saves.
    v, d, n = 1_000_000, 64, 512
    verdict = cost.gather_verdict(v * d, n * d, torch.bfloat16, cost.H100)
    assert not verdict.low and "table" in verdict.reason


def test_embedding_small_table_many_lookups_converts():
    verdict = cost.gather_verdict(100 * 64, 100_000 * 64, torch.float16, cost.H100)
    assert verdict.low


def test_crossover_is_where_table_traffic_equals_saving():
    d = 64
    n = 10_000
    assert cost.gather_verdict(n * d, n * d, torch.bfloat16, cost.H100).low  # V = N: converting pays
    assert not cost.gather_verdict(4 * n * d, n * d, torch.bfloat16, cost.H100).low  # V = 4N: it does not


def test_device_spec_rates_and_cast_cost():
    assert cost.H100.rate(torch.bfloat16) > 10 * cost.H100.rate(torch.float32)
    # 1M elements fp32 -> bf16: 6 MB through a 3350 GB/s memory
    assert abs(cost.cast_seconds(10**6, torch.float32, torch.bfloat16, cost.H100) - 6e6 / 3350e9) < 1e-12
    assert cost.spec_for("cpu") is cost.CPU


def test_a_cast_inside_its_producers_kernel_costs_only_the_low_precision_write():
    n = 10**6
    fused = cost.input_cast_seconds(n, torch.bfloat16, cost.H100, fused=True)
    assert abs(fused - 2e6 / 3350e9) < 1e-12
    assert cost.input_cast_seconds(n, torch.bfloat16, cost.H100, fused=False) == cost.cast_seconds(
        n, torch.float32, torch.bfloat16, cost.H100) == 3 * fused
