"""``nn.TransformerEncoder``'s nested-tensor fast path, computed densely on rgpu.

In eval mode with a padding mask, torch packs the batch into a nested tensor (on CPU, CUDA and
any PrivateUse1 device), runs the layers on the real tokens only and pads the result with
zeros. rgpu carries strided tensors only. The same values come from the layers on the padded
batch with the padding mask (no token attends to padding, so real tokens get the same
results) with the padded positions then zeroed, before the encoder's final norm, as torch's
unpadding does. The zeroing happens exactly when torch's own conditions for the fast path hold
(torch 2.13's TransformerEncoder.forward), so rgpu gives what CPU gives in either case.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

_original_forward = nn.TransformerEncoder.forward


def _takes_nested_path(encoder, src, mask, src_key_padding_mask):
    """Whether TransformerEncoder.forward would pack `src` into a nested tensor: its checks,
    in its order, for an encoder built with use_nested_tensor and a padding mask given."""
    first = encoder.layers[0]
    if not torch.backends.mha.get_fastpath_enabled() or first.training or src.dim() != 3:
        return False
    mask_check = getattr(encoder, "mask_check", True)
    if mask_check and torch.compiler.is_compiling():
        return False
    if mask_check:
        keep = src_key_padding_mask.logical_not()
        # Left-aligned: each row keeps a prefix (one wait, as on the CPU).
        if keep.shape[-1] > 1 and not bool((keep[..., 1:] <= keep[..., :-1]).all()):
            return False
    if mask is not None or torch.is_autocast_enabled():
        return False
    tensor_args = (src, first.self_attn.in_proj_weight, first.self_attn.in_proj_bias,
                   first.self_attn.out_proj.weight, first.self_attn.out_proj.bias,
                   first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
                   first.linear1.weight, first.linear1.bias, first.linear2.weight,
                   first.linear2.bias)
    if torch.overrides.has_torch_function(tensor_args):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensor_args))


@functools.wraps(_original_forward)
def _encoder_forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
    if not (isinstance(src, torch.Tensor) and src.device.type == "rgpu" and not src.is_nested
            and src_key_padding_mask is not None and getattr(self, "use_nested_tensor", False)):
        return _original_forward(self, src, mask, src_key_padding_mask, is_causal)
    padding = F._canonical_mask(mask=src_key_padding_mask, mask_name="src_key_padding_mask",
                                other_type=F._none_or_dtype(mask), other_name="mask",
                                target_type=src.dtype)
    canonical = F._canonical_mask(mask=mask, mask_name="mask", other_type=None, other_name="",
                                  target_type=src.dtype, check_other=False)
    nested = _takes_nested_path(self, src, canonical, padding)
    norm, self.norm, self.use_nested_tensor = self.norm, None, False
    try:
        out = _original_forward(self, src, mask, src_key_padding_mask, is_causal)
    finally:
        self.norm, self.use_nested_tensor = norm, True
    if nested:
        pad = padding != 0  # [batch, seq]: True where torch's unpadding leaves a zero
        batch_first = self.layers[0].self_attn.batch_first
        out = out.masked_fill((pad if batch_first else pad.t()).unsqueeze(-1), 0.0)
    return norm(out) if norm is not None else out


def install():
    nn.TransformerEncoder.forward = _encoder_forward
