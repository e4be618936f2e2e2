"""Every ```python block of README.md and docs/*.md runs as written, so an example cannot rot.

One test per page, in a fresh interpreter: the page's blocks run in order in one namespace (a later block may
continue an earlier one), each compiled as the page at its own line numbers, so a traceback points at the page's
line. A block, named ``"page: heading"`` (the nearest heading above it; `` (2)`` for the second block under one
heading), is one of:

- run as written (the default), with the code of :data:`RUN_WITH` before it (its free names, at the shapes its
  text names) and after it (a check of its result) where it has an entry;
- a sketch (:data:`SKETCHES`, with the reason it cannot run here): compiled, its imports run, every attribute it
  reads of a module or class exists, every call of a callable it can resolve binds to that callable's signature,
  and every name it reads is its own, the page's earlier blocks' or one of the names listed as its context;
- a signature listing (:data:`SIGNATURES`): its imports run and each ``name(parameters)`` equals the
  signature of the callable of that name, defaults included.

A new block is run as written: one that cannot run fails until it is classified here.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import inspect
import linecache
import os
import re
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: code run before (the block's free names) and after (a check of its result) a block that runs, by block
RUN_WITH = {
    "README.md: CANN two-phase API": (
        "import torch\n"
        "T, K, H, N, s, e = 3, 2, 4, 6, 1, 5\n"
        "grad, probs = torch.randn(T, H), torch.rand(T, K)\n"
        "sorted_indices = torch.tensor([0, 2, 4, 1, 3, 5], dtype=torch.int32)\n"
        "permuted_tokens = torch.randn(N, H)\n"
        "permuted_tokens_grad_out, probs_grad_out = torch.empty(N, H), torch.empty(T, K)\n",
        "assert status == aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()\n",
    ),
    "docs/aclnn.md: `MoeTokenUnpermuteWithEpGrad`": (
        "",
        # the page's "equivalent plain call", bitwise
        "import sparseops\n"
        "assert status == aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()\n"
        "want = sparseops.moe_token_unpermute_with_ep_grad(grad, sorted_idx, permuted[:4], probs, range=[1, 5],\n"
        "                                                  topk_num=2)\n"
        "assert torch.equal(ptg_out[:4], want[0]) and not ptg_out[4:].any() and torch.equal(probs_grad_out, want[1])\n",
    ),
    "docs/aclnn.md: `NsaSelectedAttentionGrad`": (
        # two sequences of 128 (cumulative [128, 256]), head_num 64, blocks of 64, 16 slots (most empty: a
        # sequence has two blocks); four KV heads and small head dims
        "import sparseops\n"
        "from sparseops.testing import make_topk_indices\n"
        "q, k = torch.randn(256, 64, 32), torch.randn(256, 4, 32)\n"
        "v = torch.randn(256, 4, 16)\n"
        "topk_indices = make_topk_indices([128, 128], [128, 128], N2=4, K=16, bs=64)\n"
        "attn_out, softmax_max, softmax_sum = sparseops.nsa_selected_attention(\n"
        "    q, k, v, topk_indices, 0.0721, 64, 64, 16, actual_seq_qlen=[128, 256], actual_seq_kvlen=[128, 256],\n"
        "    sparse_mode=2)\n"
        "attn_out_grad = torch.randn_like(attn_out)\n",
        # the page's "equivalent plain call", bitwise
        "assert status == aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()\n"
        "want = sparseops.nsa_selected_attention_grad(\n"
        "    q, k, v, attn_out, attn_out_grad, softmax_max, softmax_sum, topk_indices, scale_value=0.0721,\n"
        "    selected_block_size=64, selected_block_count=16, head_num=64, actual_seq_qlen=[128, 256],\n"
        "    actual_seq_kvlen=[128, 256], sparse_mode=2)\n"
        "assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), want))\n",
    ),
    "docs/aclnn.md: The siblings, briefly": (
        # the first block's MoE tensors (T, K, H, N, sorted_idx, permuted, probs, probs_grad_out) and the NSA ones
        # of the second, with the outs poisoned
        "from sparseops.testing import poison_\n"
        "tokens = torch.randn(T, H, dtype=torch.bfloat16)\n"
        "indices = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)\n"
        "permuted_grad, permuted_probs_grad = torch.randn(N, H, dtype=torch.bfloat16), torch.randn(N)\n"
        "mask = None\n"
        "outs = dict(permuted_out=torch.empty(4, H, dtype=torch.bfloat16),\n"
        "            sorted_idx_out=torch.empty(N, dtype=torch.int32), permuted_probs_out=torch.empty(4),\n"
        "            out=torch.empty(T, H, dtype=torch.bfloat16), tokens_grad_out=torch.empty(T, H, dtype=torch.bfloat16),\n"
        "            probs_grad_out=torch.empty(T, K), softmax_max_out=torch.empty(256, 64, 8),\n"
        "            softmax_sum_out=torch.empty(256, 64, 8), attn_out=torch.empty(256, 64, 16))\n"
        "for t in outs.values():\n"
        "    poison_(t)\n"
        "globals().update(outs)\n",
        "assert status == aclnn.ACLNN_SUCCESS, aclnn.aclGetRecentErrMsg()\n"
        "for name, t in outs.items():\n"
        "    assert not (t.isnan().any() if t.is_floating_point() else (t < 0).any()), f'{name} not written'\n",
    ),
    "docs/dsa.md: Training the indexer (`indexer_training`)": (
        # tests/integrations/test_transformers_dsa.py's tiny model; two sequences of 12 tokens per batch
        "import torch, transformers\n"
        "path = 'tiny-deepseek-v32'\n"
        "transformers.DeepseekV32Config(\n"
        "    vocab_size=40, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, n_shared_experts=1,\n"
        "    n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24,\n"
        "    qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, index_topk=5, index_head_dim=16, index_n_heads=2,\n"
        "    first_k_dense_replace=1, max_position_embeddings=128, num_attention_heads=4, num_key_value_heads=4,\n"
        "    num_hidden_layers=2).save_pretrained(path)\n"
        "seq_len = 12\n"
        "warmup_batches = batches = [torch.randint(0, 40, (2, seq_len))] * 2\n",
        "assert len(losses) == 2 and all(x.isfinite() for x in losses) and out.loss.isfinite()\n",
    ),
    "docs/moe-layer.md: One process": (
        "import torch\n"
        "batches = [(torch.randn(2, 5, 512), torch.randn(2, 5, 512))] * 2\n",
        "assert y.shape == (2, 5, 512) and loss.isfinite()\n",
    ),
    "docs/nsa-module.md: The module": (
        "",
        "assert y.shape == x.shape and sorted(info) == ['gates', 'o_cmp', 'o_slc', 'o_win', 'topk_indices']\n",
    ),
    "docs/nsa.md: NSA selected attention": (
        # the block's T (two sequences of 1024), heads, blocks and slots; one KV head, small head dims and most
        # slots empty, so that it takes a second
        "import torch\n"
        "from sparseops.testing import make_topk_indices\n"
        "q, k = torch.randn(2048, 16, 32, requires_grad=True), torch.randn(2048, 1, 32, requires_grad=True)\n"
        "v = torch.randn(2048, 1, 16, requires_grad=True)\n"
        "topk = make_topk_indices([1024, 1024], [1024, 1024], N2=1, K=16, bs=64, empty_frac=0.75)\n"
        "dout = torch.randn(2048, 16, 16)\n",
        # the seed op is the forward's backward
        "assert all(torch.equal(a, b) for a, b in zip((dq, dk, dv), (q.grad, k.grad, v.grad)))\n",
    ),
    "docs/training.md: Checkpoints": (
        # one process, no process group (the page's "One process" case): a plain model after one step
        "import torch\n"
        "from sparseops.models import CausalLM, LMConfig\n"
        "model = CausalLM(LMConfig(vocab_size=64))\n"
        "opt = torch.optim.AdamW(model.parameters())\n"
        "logits, aux = model(torch.randint(0, 64, (16,)), [0, 16])\n"
        "(logits.sum() + aux).backward()\n"
        "opt.step()\n"
        "path, s = 'ckpt', 1\n",
        "",
    ),
    "docs/transformers.md: The two switches": (
        # a checkpoint of the page's tiny example's model
        "import torch, transformers\n"
        "torch.manual_seed(0)\n"
        "path = 'tiny-qwen3-moe-prelude'\n"
        "transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(\n"
        "    vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=2,\n"
        "    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,\n"
        ")).save_pretrained(path)\n",
        "assert model.config._experts_implementation == 'sparseops'\n",
    ),
}

#: blocks that cannot run here, with the reason, and the names each takes from its context
SKETCHES = {
    "docs/moe-layer.md: Several processes: `torchrun` with gloo (CPU) or NCCL (GPU)": (
        "a torchrun script on 4 ranks (tests/distributed/test_moe_layer_ep.py runs the raw ep_group API on 2-4)",
        {"my_batches"},
    ),
    "docs/nsa-module.md: `torch.compile`": (
        "torch.compile of a model takes tens of seconds on the CPU (tests/nn/test_compile_layouts.py compiles "
        "the layer and the demo LM over changing packings)",
        {"model", "batches", "loss_fn"},
    ),
    "docs/training.md: The training loop": (
        "a torchrun script on 4 ranks, ep = 2 (tests/distributed/test_parallel.py, tests/cli/test_train.py)",
        {"my_share_of_the_global_batch"},
    ),
    "docs/training.md: Meta-device initialisation": (
        "needs a process group of 2 ranks or more (ep = 2) and a checkpoint (tests/nn/test_meta_init.py)",
        {"cfg", "path"},
    ),
    "docs/training.md: Activation checkpointing and `torch.compile`": (
        "needs a process group of 2 ranks or more (ep = 2) and minutes of compiles "
        "(tests/distributed/test_activation_checkpointing.py)",
        {"model"},
    ),
    "docs/transformers.md: The two switches (2)": (
        "torchrun on 4 ranks (ep_size 2 x fsdp_size 2; tests/integrations/test_transformers_ep.py runs the EP backend)",
        {"path"},
    ),
}

#: blocks that list signatures: ``name(parameters)`` lines, each followed by its ``-> ...`` and comment lines
SIGNATURES = {
    "docs/moe-layer.md: The expert-parallel MoE layer (`sparseops.nn`, `sparseops.distributed`)",
    "docs/moe.md: MoE token permute / unpermute with an expert-parallel window",
    "docs/nsa.md: Math",
}

#: a block that imports one of these needs transformers (the ``transformers`` extra)
_TRANSFORMERS = re.compile(r"^\s*(import|from)\s+(transformers|sparseops\.integrations\.transformers)\b", re.M)


def python_blocks(page: str) -> list[tuple[str, int, str]]:
    """``page``'s ```python blocks: (the block's name, the line of its fence, its code)."""
    blocks, heading, fence, start, code, seen = [], "", None, 0, [], {}
    for i, line in enumerate((REPO / page).read_text(encoding="utf-8").splitlines(), 1):
        if fence is None:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            elif line.startswith("```"):
                fence, start, code = line[3:].strip(), i, []
        elif line.startswith("```"):
            if fence == "python":
                name = f"{page}: {heading}"
                seen[name] = seen.get(name, 0) + 1
                blocks.append((name if seen[name] == 1 else f"{name} ({seen[name]})", start, "\n".join(code) + "\n"))
            fence = None
        else:
            code.append(line)
    return blocks


def _exec(code: str, filename: str, ns: dict, first_line: int = 1) -> None:
    """``code`` run in ``ns`` as lines ``first_line, ...`` of ``filename`` (no future flag of this module)."""
    exec(compile("\n" * (first_line - 1) + code, filename, "exec", dont_inherit=True), ns)


def _bound(tree: ast.AST) -> set[str]:
    """The names a block binds: assignments and loop/with targets, imports, definitions and their arguments."""
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
    return names


def _resolve(node: ast.expr, ns: dict, local: set[str], where: str):
    """The object ``node`` (a name or an attribute chain) names before the block runs: a name from the page's
    namespace that the block does not rebind, then attributes of modules and classes only; None when that is
    unknown (a value the block computes). A missing attribute of a module or class raises."""
    if isinstance(node, ast.Name):
        return ns.get(node.id) if node.id not in local else None
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, ns, local, where)
        if base is None or not (inspect.ismodule(base) or inspect.isclass(base)):
            return None
        if not hasattr(base, node.attr):
            raise AttributeError(f"{where}, line {node.lineno}: {getattr(base, '__name__', base)!s} has no "
                                 f"attribute {node.attr!r}")
        return getattr(base, node.attr)
    return None


def _check_sketch(name: str, page: str, line: int, code: str, context: set[str], ns: dict) -> None:
    """A sketch: compiled at the page's lines, its imports run; its module and class attributes exist, its calls
    of known callables bind, and every name it reads is bound by it, the page or its listed ``context``."""
    tree = ast.parse("\n" * line + code, page)
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports, type_ignores=[]), page, "exec", dont_inherit=True), ns)
    local = _bound(tree) - {(a.asname or a.name).split(".")[0] for n in imports for a in n.names}
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    unknown = read - local - set(ns) - set(dir(builtins)) - context
    if unknown:
        raise NameError(f"{name}: reads {sorted(unknown)}, defined neither by it, by the page's earlier blocks "
                        f"nor as its context {sorted(context)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            _resolve(node, ns, local, page)
        if isinstance(node, ast.Call) and not any(isinstance(a, ast.Starred) for a in node.args) and all(
                kw.arg is not None for kw in node.keywords):
            fn = _resolve(node.func, ns, local, page)
            try:
                sig = inspect.signature(fn) if callable(fn) else None
            except (TypeError, ValueError):  # a builtin without a signature
                sig = None
            if sig is not None:
                try:
                    sig.bind(*node.args, **{kw.arg: kw.value for kw in node.keywords})
                except TypeError as exc:
                    raise TypeError(f"{page}, line {node.lineno}: {ast.unparse(node.func)}{sig}: {exc}") from None


def _plain(sig: inspect.Signature) -> inspect.Signature:
    return sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                       return_annotation=sig.empty)


def _check_signatures(name: str, page: str, line: int, code: str, ns: dict) -> None:
    """A signature listing: statements start in column 0; an import runs, anything else is
    ``name(parameters)`` (up to its first ``->`` or comment line) and equals ``name``'s signature."""
    lines = code.splitlines()
    starts = [i for i, s in enumerate(lines) if s[:1] not in ("", " ", "#", ")")] + [len(lines)]
    checked = 0
    for a, b in zip(starts[:-1], starts[1:]):
        chunk = lines[a:b]
        first = line + 1 + a
        if re.match(r"(import|from)\s", chunk[0]):
            _exec("\n".join(chunk), page, ns, first)
            continue
        end = next((j for j, s in enumerate(chunk) if s.lstrip().startswith(("->", "#"))), len(chunk))
        doc_ns: dict = {}
        _exec("def " + "\n".join(chunk[:end]) + ": pass", page, doc_ns, first)
        (fn_name, doc_fn), = ((k, v) for k, v in doc_ns.items() if k != "__builtins__")
        if fn_name not in ns:
            raise NameError(f"{page}, line {first}: {fn_name} is not imported by the page")
        doc, real = inspect.signature(doc_fn), _plain(inspect.signature(ns[fn_name]))
        if str(doc) != str(real):
            raise AssertionError(f"{page}, line {first}: the page lists {fn_name}{doc}, the library has "
                                 f"{fn_name}{real}")
        checked += 1
    if not checked:
        raise AssertionError(f"{name}: no signature in a block listed in SIGNATURES")


def run_page(page: str, workdir: str, skip: tuple[str, ...] = ()) -> None:
    """Runs ``page``'s blocks but those named in ``skip`` in order in one namespace, in ``workdir`` (what a block
    writes lands there)."""
    text = (REPO / page).read_text(encoding="utf-8")
    linecache.cache[page] = (len(text), None, text.splitlines(True), page)  # tracebacks show the page's lines
    blocks = python_blocks(page)
    os.chdir(workdir)
    ns: dict = {}
    try:
        for name, line, code in blocks:
            if name in skip:
                continue
            if name in SIGNATURES:
                _check_signatures(name, page, line, code, ns)
            elif name in SKETCHES:
                _check_sketch(name, page, line, code, SKETCHES[name][1], ns)
            else:
                prelude, check = RUN_WITH.get(name, ("", ""))
                _exec(prelude, f"<test_docs: before {name}>", ns)
                _exec(code, page, ns, line + 1)
                _exec(check, f"<test_docs: after {name}>", ns)
    except BaseException:
        traceback.print_exc()  # from linecache: the interpreter's own printer would look for the page in workdir
        sys.exit(1)


PAGES = [p for p in ["README.md", *(f"docs/{f.name}" for f in sorted((REPO / "docs").glob("*.md")))]
         if python_blocks(p)]


def _skipped(page: str) -> tuple[str, ...]:
    """The blocks of ``page`` that cannot run here: those that need transformers where it is not installed."""
    if importlib.util.find_spec("transformers") is not None:
        return ()
    return tuple(name for name, _, code in python_blocks(page) if _TRANSFORMERS.search(code))


def _runs(page: str) -> bool:
    """Whether a block of ``page`` runs here (the page gets an interpreter)."""
    return len(_skipped(page)) < len(python_blocks(page))


def test_every_listed_block_exists():
    """The tables name blocks that exist, each in one table: a renamed heading is not silently unchecked."""
    names = {name for page in PAGES for name, _, _ in python_blocks(page)}
    listed = [*RUN_WITH, *SKETCHES, *SIGNATURES]
    assert set(listed) <= names, f"no such block: {sorted(set(listed) - names)}"
    assert len(set(listed)) == len(listed), f"in two tables: {sorted({n for n in listed if listed.count(n) > 1})}"


@pytest.fixture(scope="module")
def page_runs(request, fresh_python, tmp_path_factory):
    """The interpreters of the pages this session selects, two at a time (the CI machine's two cores, one torch
    thread each), started when the first page's test starts: page -> the future of its ``CompletedProcess``."""
    pages = [item.callspec.params["page"] for item in request.session.items
             if item.module is request.module and getattr(item, "originalname", "") == "test_python_blocks_run"]
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        # the fused CPU kernels compile on first use (seconds; tests/moe covers them); the blocks check the API
        yield {page: pool.submit(fresh_python, f"from tests.test_docs import run_page\n"
                                 f"run_page({page!r}, {str(tmp_path_factory.mktemp('docs'))!r}, {_skipped(page)!r})\n",
                                 SPARSEOPS_COMPILE="0", OMP_NUM_THREADS="1")
               for page in pages if _runs(page)}
    finally:
        pool.shutdown(cancel_futures=True)  # the pages a stopped session (-x) does not reach


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page, page_runs):
    skipped, ran = _skipped(page), _runs(page)
    if ran:
        r = page_runs[page].result()
        if r.returncode != 0:
            pytest.fail(f"a python block of {page} fails:\n{r.stderr[-6000:]}", pytrace=False)
    if skipped:
        pytest.skip(f"{list(skipped)} need transformers (the transformers extra)" + ("; the others ran" if ran else ""))
