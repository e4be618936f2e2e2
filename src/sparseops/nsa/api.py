"""Public NSA ops (placeholder until the NSA issue lands)."""


def _todo(*args, **kwargs):
    raise NotImplementedError("sparseops NSA ops are not implemented yet")


nsa_selected_attention = nsa_selected_attention_grad = _todo
