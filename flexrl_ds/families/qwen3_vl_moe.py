"""Qwen3-VL MoE (`qwen3_vl_moe`): the Qwen3-VL vision tower, prompts and positions, with a sparse
decoder whose experts are fused 3D parameters (transformers' `modeling_qwen3_vl_moe.py`).

Under ZeRO-3, ranks that route their tokens to different experts must not gather different parameter
sets: the sparse block is a ZeRO-3 leaf module (`zero3_leaf_modules`, given to DeepSpeed's
`set_z3_leaf_modules` by models/zero3.py), gathered whole, as OpenRLHF and veRL do. The decoder returns its router
logits, from which the trainer reports the router's auxiliary loss (models/moe.py; in the loss with
`flexrl.rl.router_aux_loss_coef` > 0).
"""

from __future__ import annotations

from flexrl_ds.families.qwen3_vl import Qwen3_VL


class Qwen3_VL_MoE(Qwen3_VL):
    model_type = "qwen3_vl_moe"
    display_name = "Qwen3-VL MoE"
    hf_class = "Qwen3VLMoeForConditionalGeneration"

    def run_decoder(self, hf_model, embeds_1LH, position_ids, extras, **kwargs):
        """With the router logits (the auxiliary loss, models/moe.py)."""
        return super().run_decoder(hf_model, embeds_1LH, position_ids, extras, output_router_logits=True, **kwargs)

    def router_logits(self, output):
        return list(output.router_logits) if output.router_logits else None

    def router_top_k(self, config):
        return int(config.get_text_config().num_experts_per_tok)

    def zero3_leaf_modules(self, hf_model):
        """The sparse MoE block class(es) found in the model."""
        return sorted({type(m) for m in hf_model.modules() if type(m).__name__.endswith("SparseMoeBlock")},
                      key=lambda cls: cls.__name__)


QWEN3_VL_MOE = Qwen3_VL_MoE()
