"""A small model step that uses both op families, compiled with ``torch.compile(fullgraph=True)`` (inductor):
no graph break, and the same loss and parameter gradients as eager."""

import torch

import sparseops
from sparseops.testing import assert_close, make_topk_indices

SEQ = [24, 9]  # two packed sequences; the second ends inside a block
N1, N2, D, DV, BS, KB = 4, 2, 16, 16, 16, 2
E, K, WINDOW = 4, 2, [-40, 60]  # experts, top-k, an EP window given with a negative start


class Block(torch.nn.Module):
    """NSA selected attention followed by a top-k MoE feed-forward on an expert-parallel window."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.wq = torch.nn.Parameter(torch.randn(DV * 2, N1 * D, generator=g) * 0.2)
        self.wk = torch.nn.Parameter(torch.randn(DV * 2, N2 * D, generator=g) * 0.2)
        self.wv = torch.nn.Parameter(torch.randn(DV * 2, N2 * DV, generator=g) * 0.2)
        self.router = torch.nn.Parameter(torch.randn(N1 * DV, E, generator=g) * 0.2)
        self.experts = torch.nn.Parameter(torch.randn(E, N1 * DV, N1 * DV, generator=g) * 0.1)

    def forward(self, x, topk, cu):
        T = x.shape[0]
        q = (x @ self.wq).view(T, N1, D)
        k = (x @ self.wk).view(T, N2, D)
        v = (x @ self.wv).view(T, N2, DV)
        att, _, _ = sparseops.nsa_selected_attention(
            q, k, v, topk, D**-0.5, N1, BS, KB, actual_seq_qlen=cu, actual_seq_kvlen=cu, sparse_mode=2
        )
        h = att.reshape(T, N1 * DV)
        probs, ids = torch.softmax(h @ self.router, dim=-1).topk(K, dim=-1)
        rows, sorted_indices, _ = sparseops.moe_token_permute_with_ep(h, ids, range=WINDOW)
        # the expert of every local row: rows are expert-sorted, so it is the sorted id list's window
        n = ids.numel()
        s = max(0, min(n, WINDOW[0] + n if WINDOW[0] < 0 else WINDOW[0]))
        row_expert = ids.flatten().sort(stable=True).values[s : s + rows.shape[0]]
        y = torch.bmm(rows.unsqueeze(1), self.experts[row_expert]).squeeze(1)
        out = sparseops.moe_token_unpermute_with_ep(torch.relu(y), sorted_indices, probs, K, WINDOW)
        return (out - h).pow(2).mean()


def test_model_step_compiles_fullgraph_and_matches_eager():
    import torch._dynamo
    import torch._inductor.config as inductor_config

    T = sum(SEQ)
    x = torch.randn(T, DV * 2, generator=torch.Generator().manual_seed(1))
    topk = make_topk_indices(SEQ, SEQ, N2, KB, BS, causal=True, seed=2)
    cu = [SEQ[0], T]
    model = Block()
    torch._dynamo.reset()
    with inductor_config.patch(compile_threads=1):
        compiled = torch.compile(model, fullgraph=True)
        results = []
        for fn in (model, compiled):
            model.zero_grad(set_to_none=True)
            loss = fn(x, topk, cu)
            loss.backward()
            results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    names = ["loss"] + [n for n, _ in model.named_parameters()]
    for name, eager, comp in zip(names, *results):
        assert torch.isfinite(eager).all(), name
        assert eager.abs().sum() > 0, f"{name}: an all-zero gradient would make this comparison vacuous"
        assert_close(comp, eager, torch.float32, name=name)
