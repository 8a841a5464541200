import pytest

from testbed.report.paper import fig_7_8, label, paper_bits, table_ii


def test_paper_arithmetic_reproduces_its_printed_numbers():
    voltage = paper_bits("voltage", 197, 2, 768)
    assert voltage == 2_420_736
    assert 12 * voltage / (10 * 2**20) * 1000 == pytest.approx(2770.31, abs=0.01)  # Table IV
    assert 12 * paper_bits("prism", 197, 2, 768) / (10 * 2**20) * 1000 == pytest.approx(
        140.63, abs=0.01
    )
    assert 12 * paper_bits("astra", 197, 2, 768) / (10 * 2**20) * 1000 == pytest.approx(
        1.81, abs=0.01
    )
    assert round(voltage / paper_bits("trace-b", 197, 2, 768)) == 2426  # Fig. 7
    assert round(voltage / paper_bits("astra", 197, 2, 768)) == 1528
    assert round(voltage / paper_bits("trace-b", 197, 2, 768, level_k=2)) == 22624


def test_payload_table_rows_and_ratios():
    lines = table_ii()
    rows = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ")}
    assert rows["trace-b K=1024"] == "| trace-b K=1024 | 998 | 998 | 1.00 |"
    assert "| 2,420,736 | 2,433,024 | 1.01 |" in rows["voltage"]


def test_compression_table_has_every_model_and_device_count():
    text = "\n".join(fig_7_8())
    for model, devices in (("vit-b16", 2), ("vit-b16", 3), ("vivit-b", 10)):
        assert f"| {model} | {devices} |" in text
    assert "| vit-b16 | 2 | 1,536 | 2,438 | 4,837 | 22,739 |" in text


def test_trace_b_rows_are_labelled_by_their_level():
    assert label("trace-b", "K=1024,level_k=32") == "trace-b K=32"
    assert label("trace-b", "K=1024") == "trace-b K=1024"
    assert label("astra", "K=1024") == "astra"
