"""`python -m bench switch`: its smallest real run (the bundled model and a tiny random llama,
CPU) writes a JSON with both measurements and a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from bench.__main__ import main


def test_switch_smallest_run(tmp_path: Path):
    assert main(["switch", "--rounds", "1", "--stall-tokens", "24", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "switch.json").read_text())
    assert result["bench"] == "switch" and result["command"].startswith("python -m bench switch")
    med = result["switch"]["median"]
    assert set(med) == {"coder", "tiny"}
    for m in med.values():
        assert m["switch_ttft_s"] > m["load_s"] > 0 and m["warm_ttft_s"] > 0
    weights = result["switch"]["weights_bytes"]
    assert max(weights.values()) <= result["switch"]["budget_bytes"] < sum(weights.values())
    assert result["stall"]["median_gap_ms"] > 0
    assert (tmp_path / "switch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
