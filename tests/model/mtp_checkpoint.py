"""Tiny glm4_moe, glm_moe_dsa and deepseek_v32 checkpoints with a NextN (MTP) layer at index num_hidden_layers, in the
on-disk layout of GLM and DeepSeek-V3, built from transformers' own model classes and MtpModel (test_mtp.py,
test_dsa_mtp.py)."""
from __future__ import annotations

import torch

from radixserve.models.block_config import DSA_FAMILIES
from tests.model.test_families import COMMON, FAMILIES


def build_glm_mtp(folder, seed: int = 0, exact: bool = False, shared_copies: bool = False, family: str = "glm4_moe",
                  **overrides):
    """Save a random `family` model (FAMILIES' config, `overrides` over it) with one MTP layer into `folder`; returns
    (hf model, hf MtpModel), fp32, eval.
    `exact`: attention and MLP outputs zeroed in target and draft, eh_proj = [I | 0] and shared_head.norm = the
    final norm, so the target's next token depends on the current one only and the draft predicts it exactly.
    `shared_copies`: the layer also stores embed_tokens and shared_head.head (copies of the target's)."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    mtp = (dsa_mtp_model(model) if family in DSA_FAMILIES else MtpModel(model, 1)).eval()
    with torch.no_grad():
        # MtpModel's own layers come uninitialized (whatever memory held): give every one of their tensors values
        for tensor in mtp.layers.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn_like(tensor) * model.config.initializer_range)
        for module in (model, mtp):
            for name, tensor in module.state_dict().items():
                if name.endswith("mlp.gate.weight"):
                    tensor.copy_(torch.randn_like(tensor) * 0.5)
                elif name.endswith("e_score_correction_bias"):
                    tensor.copy_(torch.rand_like(tensor) * 0.1)
                elif name.endswith("norm.weight"):
                    tensor.copy_(1 + 0.2 * torch.randn_like(tensor))
                elif name.endswith("eh_proj.weight"):
                    tensor.copy_(torch.randn_like(tensor) * 0.1)
                if exact and (name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))):
                    tensor.zero_()
        if exact:
            h = model.config.hidden_size
            layer = mtp.layers[0]
            layer.eh_proj.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
            layer.enorm.weight.fill_(1.0)
            layer.post_norm.weight.copy_(model.model.norm.weight)
    model.save_pretrained(folder, safe_serialization=True)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors.update(glm_mtp_tensors(mtp, model.config.num_hidden_layers, shared_copies))
    save_file(tensors, path, metadata={"format": "pt"})
    return model, mtp


def dsa_mtp_model(model):
    """transformers 5.25's MtpModel over a glm_moe_dsa or deepseek_v32 model. It builds the layer (the family's decoder
    layer as layer 0 of the MTP config: glm_moe_dsa's indexer_types[0] is "full", deepseek_v32's layers are all full, so
    a full indexer of its own; MoE, first_k_dense_replace being 0) once the config names num_mtp_layers and the MTP
    layer types, which neither config does; its forward_layer then needs a causal mask (there is no mask function for
    "indexed_attention" layers) and the block's hidden states alone (GLM-5's block returns (hidden, top-k)). Both are
    given here; every computation stays transformers'."""
    from transformers.modeling_layers import MtpModel

    c = model.config
    c.num_mtp_layers, c.mtp_layer_types, c.mtp_mlp_layer_types = 1, ["indexed_attention"], ["sparse"]
    mtp = MtpModel(model, 1)
    for name in ("num_mtp_layers", "mtp_layer_types", "mtp_mlp_layer_types"):
        delattr(c, name)   # the saved config.json stays the family's (num_nextn_predict_layers only)

    def causal_mask(layer_idx, inputs_embeds, cache, position_ids):
        n = inputs_embeds.shape[1]
        return {"attention_mask": torch.ones(n, n, dtype=torch.bool).tril()[None, None]}
    mtp.create_masks_for_mtp_layer = causal_mask
    if c.model_type == "glm_moe_dsa":
        mtp.layers[0].mtp_block.register_forward_hook(lambda module, args, out: out[0])
    return mtp


def glm_mtp_tensors(mtp, num_layers: int, shared_copies: bool = False) -> dict[str, torch.Tensor]:
    """MtpModel's layer 0 under GLM's checkpoint names (model.layers.N.*, experts one tensor each)."""
    prefix = f"model.layers.{num_layers}."
    out = {}
    for name, tensor in mtp.state_dict().items():
        if not name.startswith("layers.0."):
            continue
        short = name.removeprefix("layers.0.").replace("mtp_block.", "").replace("post_norm", "shared_head.norm")
        if short == "mlp.experts.gate_up_proj":
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = tensor[e, :half].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = tensor[e, half:].clone()
        elif short == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[prefix + short] = tensor.clone()
    if shared_copies:
        out[prefix + "embed_tokens.weight"] = mtp.embed_tokens.weight.detach().clone()
        out[prefix + "shared_head.head.weight"] = mtp.shared_head.weight.detach().clone()
    return out


@torch.no_grad()
def hf_mtp_drafts(model, mtp, tokens: list[int], k: int
                  ) -> tuple[list[int], list[float], list[torch.Tensor]]:
    """transformers' MTP chain after `tokens` (the last one just sampled): k greedy drafts, each with its
    top-2 logit gap and its logits (V,). The draft layer runs over the whole sequence without a cache at every step (tokens
    shifted by one against the target's post-norm hidden states, then its own output and draft)."""
    ids = torch.tensor([tokens])
    hidden = model(ids[:, :-1], output_hidden_states=True).hidden_states[-1]
    inputs = ids[:, 1:]
    drafts, gaps, rows = [], [], []
    for _ in range(k):
        positions = torch.arange(inputs.shape[1]).unsqueeze(0)
        out = mtp.forward_layer(0, hidden, positions, None, input_ids=inputs)
        logits = mtp._project_to_logits(out[:, -1])[0]
        top = logits.topk(2).values
        token = int(logits.argmax())
        drafts.append(token)
        gaps.append(float(top[0] - top[1]))
        rows.append(logits)
        hidden = torch.cat([hidden, out[:, -1:]], dim=1)
        inputs = torch.cat([inputs, torch.tensor([[token]])], dim=1)
    return drafts, gaps, rows
