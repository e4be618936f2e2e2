"""Public MoE ops (placeholder until the MoE foundation lands)."""


def _todo(*args, **kwargs):
    raise NotImplementedError("sparseops MoE ops are not implemented yet")


moe_token_permute_with_ep = moe_token_unpermute_with_ep = _todo
moe_token_unpermute_with_ep_grad = moe_token_permute_with_ep_grad = _todo
