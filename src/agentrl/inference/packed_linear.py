"""oneDNN-packed weights for the served model's Linear layers on CPU.

An ``nn.Linear`` on CPU multiplies with a plain-layout weight; oneDNN's matmul on a weight reordered once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile``'s CPU backend does with frozen
weights) is faster for the few rows of a decode step. Measured on a 2-core AVX-512 (bf16) CPU, one thread, the
embedded model's shapes: bf16 bit-identical and about 2x faster for one row, 1.2-1.7x for 16 (the LM head most);
fp32 equal to float rounding, 1.2-2.5x faster from 4 rows on, slower for one or two rows except the LM head
(1.25x faster). Every row count multiplies with the packed weight, and a single row as two in the layers where
oneDNN's one-row kernel sums in another order (:func:`single_row_differs`, probed at packing): a row's result is
then the same bits whatever other rows share the call, where the plain fp32 GEMM takes another kernel under 4 rows
(an engine step's rows come from several requests, and a prompt served from the prefix cache computes only its last
rows: the answer to a request must depend on neither). :func:`pack_linears` turns every ``nn.Linear`` of a CPU model
into a :class:`PackedLinear` (still an ``nn.Linear``: the same parameters, state dict and forward hooks) holding
the reordered copy of its weight.

``bf16_matmuls`` (the engine's ``--dtype auto`` on a CPU with bf16 matrix instructions) keeps an fp32 model fp32
but has every layer except the LM head multiply in bf16: its packed copy is bf16, its input is rounded to bf16 and
its output returned in fp32. The residual stream, norms, attention and the LM head stay fp32, as in the trainer's
bf16 mode (bf16 layers, fp32 head), so the engine-vs-trainer logprob gap stays within the precision test's bound,
where a bf16 model (bf16 logits) exceeds it.

The copy does not follow in-place changes of the weight: call :func:`repack` after loading new weights, or make the
new copies with :meth:`PackedLinear.packing` before swapping them in with the weights (the batcher does). The
reordered copies take as much memory as the weights.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def packing_supported(model: nn.Module) -> bool:
    """Whether ``model`` is an fp32 or bf16 model on a CPU whose oneDNN supports its dtype."""
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return parameter.dtype == torch.float32 or (
        parameter.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies with a oneDNN-reordered copy of its weight (made by :meth:`repack`) in
    ``matmul_dtype`` (its weight's dtype, or bf16 for an fp32 layer that multiplies in bf16); a single row as two
    where ``pad_single_row`` (:func:`single_row_differs`)."""

    packed: torch.Tensor
    packed_bias: torch.Tensor | None
    matmul_dtype: torch.dtype
    pad_single_row: bool

    def repack(self) -> None:
        self.packed, self.packed_bias = self.packing(self.weight, self.bias)

    def packing(self, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reordered copies of ``weight`` and ``bias`` (this layer's, or new ones to swap in later)."""
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(self.matmul_dtype), None)
        return packed, None if bias is None else bias.detach().to(self.matmul_dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.to(self.matmul_dtype)
        single = self.pad_single_row and rows.numel() == self.in_features
        if single:
            rows = rows.reshape(1, -1).expand(2, -1)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.packed_bias, "none", [], "")
        if single:
            out = out[:1].reshape(*input.shape[:-1], self.out_features)
        return out.to(input.dtype)


@functools.cache
def single_row_differs(in_features: int, out_features: int, matmul_dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies one row of a packed layer of this shape otherwise than the same row among others:
    its one-row kernel splits the sum over the inputs for large layers (measured on AVX-512: from 1,536 inputs,
    fp32 and bf16), so the row's result differs in the last bits. Probed once per shape with random values, in
    fp32 too (a bf16 output hides most such differences in its rounding)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    rows = torch.randn(8, in_features, generator=generator)
    for dtype in {torch.float32, matmul_dtype}:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), None)
        together = torch.ops.mkldnn._linear_pointwise(rows.to(dtype), packed, None, "none", [], "")
        alone = [torch.ops.mkldnn._linear_pointwise(rows[i:i + 1].to(dtype), packed, None, "none", [], "")
                 for i in range(rows.shape[0])]
        if not torch.equal(torch.cat(alone), together):
            return True
    return False


def pack_linears(model: nn.Module, *, bf16_matmuls: bool = False) -> int:
    """Make every ``nn.Linear`` of ``model`` a :class:`PackedLinear` (if :func:`packing_supported`); returns how
    many layers are packed. ``bf16_matmuls``: the fp32 layers other than the LM head multiply in bf16."""
    if not packing_supported(model):
        return 0
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [module for module in model.modules() if type(module) is nn.Linear]
    for module in linears:
        module.__class__ = PackedLinear
        in_bf16 = bf16_matmuls and module is not head and module.weight.dtype == torch.float32
        module.matmul_dtype = torch.bfloat16 if in_bf16 else module.weight.dtype
    count = repack(model)
    for module in linears:
        module.pad_single_row = single_row_differs(module.in_features, module.out_features, module.matmul_dtype)
    return count


def repack(model: nn.Module) -> int:
    """Reorder the current weights of ``model``'s packed layers again (after an in-place weight update)."""
    packed = [module for module in model.modules() if isinstance(module, PackedLinear)]
    with torch.no_grad():
        for module in packed:
            module.repack()
    return len(packed)
