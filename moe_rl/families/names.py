"""HF tensor names more than one family uses."""
from __future__ import annotations

# experts as separate gate / up / down projections under the layer's ``mlp``
GATED_MLP_EXPERTS = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                     "mlp.experts.{e}.down_proj.weight")
