"""A token dispatcher without host synchronisation for MoE layers whose experts all live on this
rank (expert parallel 1, expert tensor parallel 1), in place of megatron-core's allgather /
alltoall dispatchers, which copy the token counts to the host (``tokens_per_expert.cpu()``) and
permute with ``masked_select`` (whose output size the host must learn) in every MoE layer.

:class:`SortTokenDispatcher` sorts the (token, expert) pairs by expert instead: every token is
routed to exactly top-k experts (moe_rl drops no token: no expert capacity), so each step has a
shape known in advance: the chosen experts of each token (a stable sort of its routing-map row),
one stable sort of the T x K expert ids, the counts summed on the device. The permuted rows and
their gates come out in megatron's order (by expert, tokens ascending within one), and the
combine adds each row back to its token as megatron's unpermute does, so both agree bit for bit
on CPU (``tests/trainer/test_sort_dispatcher.py``). The counts stay on the device for the
grouped experts (:mod:`moe_rl.trainer.grouped_experts`), which never read them on the host;
megatron's loop over the experts reads them once (``tolist``) to split its rows.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher


class SortTokenDispatcher(MoETokenDispatcher):
    """Permutation by sort, counts on the device (see the module's doc)."""

    def __init__(self, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection or
                         get_default_pg_collection())
        self.topk = config.moe_router_topk

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """The tokens as rows, and where each (token, expert) pair goes: ``rows`` (each
        permuted row's token), the counts per expert and the permuted gates."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.view(-1, hidden_states.shape[-1])
        self.tokens = hidden.shape[0]
        # each token's K experts, ascending (False sorts first: chosen, in expert order)
        chosen = torch.argsort((~routing_map).to(torch.int8), dim=1, stable=True)[:, :self.topk]
        order = torch.argsort(chosen.reshape(-1), stable=True)   # by expert, tokens ascending
        self.rows = torch.div(order, self.topk, rounding_mode="floor")
        self.counts = routing_map.sum(dim=0)
        self.permuted_probs = probs.gather(1, chosen).reshape(-1).index_select(0, order)
        return hidden, probs

    def token_dispatch(self, hidden_states, probs):
        """Nothing to send: every expert is local."""
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        """The rows grouped by expert, the counts per expert (on the device), their gates."""
        return hidden_states.index_select(0, self.rows), self.counts, self.permuted_probs

    def combine_preprocess(self, hidden_states):
        """Each expert row added back to its token (megatron's unpermute, in its dtype)."""
        out = hidden_states.new_zeros((self.tokens, hidden_states.shape[-1]))
        return out.index_add_(0, self.rows, hidden_states)

    def token_combine(self, hidden_states):
        """Nothing to receive: every expert is local."""
        return hidden_states

    def combine_postprocess(self, hidden_states):
        """Back to the layer's [s, b, h] shape."""
        return hidden_states.view(self.hidden_shape)


def use_sort_dispatcher(model) -> int:
    """Every MoE layer of ``model`` dispatches by sort (in place; its experts must all be local
    and grouped); returns how many layers changed."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    changed = 0
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.token_dispatcher = SortTokenDispatcher(module.config)
            changed += 1
    return changed
