"""README.md's python blocks run as written, in a fresh interpreter, so the example cannot rot."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

#: sections whose blocks are fragments: the code that defines their free names (at the shapes the block's
#: comments name) and a check of their result, by the section's ``## `` heading
FRAGMENTS = {
    "CANN two-phase API": (
        "import torch\n"
        "T, K, H, N, s, e = 3, 2, 4, 6, 1, 5\n"
        "grad, probs = torch.randn(T, H), torch.rand(T, K)\n"
        "sorted_indices = torch.tensor([0, 2, 4, 1, 3, 5], dtype=torch.int32)\n"
        "permuted_tokens = torch.randn(N, H)\n"
        "permuted_tokens_grad_out, probs_grad_out = torch.empty(N, H), torch.empty(T, K)\n",
        "assert status == aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()\n",
    ),
}


def _python_blocks() -> list[tuple[str | None, int, str]]:
    """README.md's ```python blocks: (the ``## `` heading above, the line of the fence, the code)."""
    blocks, heading, fence, start, code = [], None, None, 0, []
    for i, line in enumerate(README.read_text(encoding="utf-8").splitlines(), 1):
        if fence is None:
            if line.startswith("## "):
                heading = line[3:].strip()
            elif line.startswith("```"):
                fence, start, code = line[3:].strip(), i, []
        elif line.startswith("```"):
            if fence == "python":
                blocks.append((heading, start, "\n".join(code) + "\n"))
            fence = None
        else:
            code.append(line)
    return blocks


def _program(blocks: list[tuple[str | None, int, str]]) -> str:
    """One program running ``blocks`` in order in one namespace (a later block may continue an earlier one),
    each compiled as README.md at its own line numbers, so a traceback points at the README's line."""
    parts = []
    for heading, line, code in blocks:
        prelude, check = FRAGMENTS.get(heading, ("", ""))
        if prelude:
            parts.append((f"<test_docs: prelude of '{heading}'>", prelude))
        parts.append(("README.md", "\n" * line + code))
        if check:
            parts.append((f"<test_docs: check of '{heading}'>", check))
    return f"ns = {{}}\nfor name, code in {parts!r}:\n    exec(compile(code, name, 'exec'), ns)\n"


def test_readme_python_blocks_run(fresh_python):
    blocks = _python_blocks()
    headings = {heading for heading, _, _ in blocks}
    assert "Example" in headings, f"README.md: no ```python block under '## Example' (blocks under {headings})"
    assert set(FRAGMENTS) <= headings, f"README.md: no ```python block under {set(FRAGMENTS) - headings}"
    # the fused CPU kernels compile on first use (seconds; tests/moe covers them); the example checks the API
    r = fresh_python(_program(blocks), SPARSEOPS_COMPILE="0")
    if r.returncode != 0:
        pytest.fail(f"a python block of README.md fails:\n{r.stderr[-3000:]}", pytrace=False)
