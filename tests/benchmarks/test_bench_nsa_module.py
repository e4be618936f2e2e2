"""benchmarks/nsa_module.py in its tiny ``--smoke`` configuration: the correctness gate against the float64
references runs before anything is timed, and the run is written where ``--out`` says. No timing assertions."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import nsa_module  # noqa: E402


def test_nsa_module_smoke(tmp_path):
    assert nsa_module.main(["--smoke", "--no-peers", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "nsa_module_smoke.json").read_text())
    assert record["smoke"] and record["checks"]
    assert [r["T"] for r in record["core"]] == [256, 512]
    assert all(r["ours_fwdbwd_s"] > 0 and r["sdpa_fwdbwd_s"] > 0 for r in record["core"])


def test_visible_pairs_and_flops_count_what_the_branches_attend():
    """The floor's pair counts against a key-by-key count of what each query sees (the window's and the compressed
    blocks' rules, the selected blocks up to the token), and the FLOPs from them."""
    import torch

    blocks = {"l": 8, "d": 4, "lb": 16, "n": 3, "w": 10}
    T = 70
    g = torch.Generator().manual_seed(0)
    topk = torch.randint(-1, (T + 15) // 16, (T, 1, 3), generator=g)
    got = nsa_module.visible_pairs(T, topk, blocks)
    slc = sum(1 for t in range(T) for b in topk[t, 0].tolist() if b >= 0 for p in range(b * 16, b * 16 + 16) if p <= t)
    win = sum(1 for t in range(T) for p in range(T) if t - 10 < p <= t)
    cmp = sum(1 for t in range(T) for j in range(T) if j * 4 + 8 - 1 <= t)
    assert got == {"slc": slc, "win": win, "cmp": cmp}
    heads = {"N1": 4, "N2": 2, "D": 8}
    proj = 2 * (2 * T * 32 * (4 * 8 + 3 * 2 * 2 * 8 + 3 * 4) + 2 * T * 4 * 8 * 32)
    assert nsa_module.module_flops(T, 32, got, heads) == proj + 14 * 8 * 4 * (slc + win + cmp) + 2 * 8 * 4 * cmp
