"""oneDNN-packed weights for the served model's Linear layers on CPU.

An ``nn.Linear`` on CPU multiplies with a plain-layout weight; oneDNN's matmul on a weight reordered once into its
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what ``torch.compile``'s CPU backend does with frozen
weights) is faster for the few rows of a decode step. Measured on a 2-core AVX-512 (bf16) CPU, one thread, the
embedded model's shapes: bf16 bit-identical and about 2x faster for one row, 1.2-1.7x for 16 (the LM head most);
fp32 equal to float rounding, 1.2-2.5x faster from 4 rows on, slower for one or two rows except the LM head
(1.25x faster).

**A row's result does not depend on the rows beside it** (an engine step's rows come from several requests, and a
prompt served from the prefix cache computes only its last rows: the answer to a request must depend on neither),
where the plain fp32 GEMM takes another kernel under 4 rows. Which kernel oneDNN takes for a call depends on the
CPU (AVX-512, AVX512-BF16, AMX tiles), the threads and the row count, so nothing is assumed: at packing,
:func:`row_layout` probes each layer shape on this CPU and picks how its rows are laid out in calls: as they come
(AVX-512 and AVX512-BF16 machines measured so far), a single row as two (where oneDNN's one-row kernel sums in
another order), or calls of exactly ``ROW_BLOCK`` rows (where kernels are chosen by the row count: every call then
has the same shape). The engine's start-up line says when a layer needs blocks, or when not even they agree.
:func:`pack_linears` turns every ``nn.Linear`` of a CPU model into a :class:`PackedLinear` (still an ``nn.Linear``:
the same parameters, state dict and forward hooks) holding the reordered copy of its weight.

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
from dataclasses import dataclass

import torch
from torch import nn


def packing_supported(model: nn.Module) -> bool:
    """Whether ``model`` is an fp32 or bf16 model on a CPU whose oneDNN supports its dtype."""
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return parameter.dtype == torch.float32 or (
        parameter.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


ROW_BLOCK = 32
"""Rows per call of a layer whose kernels depend on the row count (:func:`row_layout`)."""
PROBE_ROWS = (1, 2, 3, 4, 8, 15, 16, 17, 31, 32, 33)
"""The row counts :func:`row_layout` tries, each at ``PROBE_OFFSETS`` among ``PROBE_TOGETHER`` rows (kernels switch
at such counts: oneDNN by its register and tile blocking, the matrix units it finds and its thread split)."""
PROBE_OFFSETS = (0, 1, 17)
PROBE_TOGETHER = 50


@dataclass(frozen=True)
class RowLayout:
    """How a layer multiplies its rows so that a row's result does not depend on the rows beside it.

    ``pad_single_row``: a single row is multiplied as two (the kernels agree for every other count);
    ``block_rows``: rows go in calls of exactly this many, the last padded (the kernels depend on the count);
    ``exact``: a row then gets the same bits whatever shares its call (false: not even in blocks, on this CPU)."""

    pad_single_row: bool = False
    block_rows: int | None = None
    exact: bool = True


def packed_matmul(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's matmul of ``rows`` [m, in] with a reordered weight (the one kernel call of every packed layer)."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")


def multiply(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, layout: RowLayout) -> torch.Tensor:
    """``rows`` [m, in] times the packed weight, laid out in calls as ``layout`` says."""
    count = rows.shape[0]
    if layout.block_rows is not None:
        block = layout.block_rows
        padded = torch.cat([rows, rows[-1:].expand(-count % block, -1)]) if count % block else rows
        return torch.cat([packed_matmul(chunk, packed, bias) for chunk in padded.split(block)])[:count]
    if layout.pad_single_row and count == 1:
        return packed_matmul(rows.expand(2, -1), packed, bias)[:1]
    return packed_matmul(rows, packed, bias)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies with a oneDNN-reordered copy of its weight (made by :meth:`repack`) in
    ``matmul_dtype`` (its weight's dtype, or bf16 for an fp32 layer that multiplies in bf16), its rows laid out in
    calls as ``row_layout`` says."""

    packed: torch.Tensor
    packed_bias: torch.Tensor | None
    matmul_dtype: torch.dtype
    row_layout: RowLayout

    def repack(self) -> None:
        self.packed, self.packed_bias = self.packing(self.weight, self.bias)

    def packing(self, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reordered copies of ``weight`` and ``bias`` (this layer's, or new ones to swap in later)."""
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(self.matmul_dtype), None)
        return packed, None if bias is None else bias.detach().to(self.matmul_dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.to(self.matmul_dtype).reshape(-1, self.in_features)
        out = multiply(rows, self.packed, self.packed_bias, self.row_layout)
        return out.reshape(*input.shape[:-1], self.out_features).to(input.dtype)


@functools.cache
def row_layout(in_features: int, out_features: int, matmul_dtype: torch.dtype) -> RowLayout:
    """Probe how this CPU's kernels multiply a layer of this shape (random values, this process's threads): rows
    in calls of each count of :data:`PROBE_ROWS`, from each of ``PROBE_OFFSETS``, against the same rows among
    ``PROBE_TOGETHER``, in fp32 too (a bf16 output hides most differences in its rounding). The first layout under
    which all agree: the plain call; a single row as two (oneDNN's one-row kernel splits the sum over the inputs for
    large layers, measured on AVX-512 from 1,536 inputs); calls of ``ROW_BLOCK`` rows (kernels chosen by the row
    count). Where not even blocks agree, blocks marked not ``exact``."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator)
    rows = torch.randn(PROBE_TOGETHER, in_features, generator=generator)
    packs = [(rows.to(dtype), torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), None))
             for dtype in {torch.float32, matmul_dtype}]

    def agrees(layout: RowLayout) -> bool:
        for values, packed in packs:
            together = multiply(values, packed, None, layout)
            for offset in PROBE_OFFSETS:
                for count in PROBE_ROWS:
                    part = values[offset:offset + count]
                    if not torch.equal(multiply(part, packed, None, layout), together[offset:offset + count]):
                        return False
        return True

    for layout in (RowLayout(), RowLayout(pad_single_row=True)):
        if agrees(layout):
            return layout
    blocks = RowLayout(block_rows=ROW_BLOCK)
    return blocks if agrees(blocks) else RowLayout(block_rows=ROW_BLOCK, exact=False)


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
        module.row_layout = row_layout(module.in_features, module.out_features, module.matmul_dtype)
    return count


def row_layouts(model: nn.Module) -> set[RowLayout]:
    """The row layouts of ``model``'s packed layers (what the engine's start-up line reports)."""
    return {module.row_layout for module in model.modules() if isinstance(module, PackedLinear)}


def repack(model: nn.Module) -> int:
    """Reorder the current weights of ``model``'s packed layers again (after an in-place weight update)."""
    packed = [module for module in model.modules() if isinstance(module, PackedLinear)]
    with torch.no_grad():
        for module in packed:
            module.repack()
    return len(packed)
