"""Per-chip TPU figures for rooflines and HBM budgets, the product names of slices, and the peak
figures of common NVIDIA GPUs (for the training loop's MFU).

Public specification numbers, per chip (Google Cloud TPU documentation, "System architecture"
pages of TPU v4, v5e, v5p and v6e (Trillium)):

======  ======================  ===============  ==============
chip    peak bf16 (TFLOP/s)     HBM bandwidth    HBM capacity
======  ======================  ===============  ==============
v4      275                     1,200 GB/s       32 GiB
v5e     197                     819 GB/s         16 GiB
v5p     459                     2,765 GB/s       95 GiB
v6e     918                     1,640 GB/s       32 GiB
======  ======================  ===============  ==============

These are peak figures: a roofline step time computed from them is a lower bound on the real one
(no kernel reaches peak FLOP/s and peak bandwidth, and collectives are not in it).

Slice names. ``v5e-N`` and ``v6e-N`` count chips (one TensorCore each); ``v4-N`` and ``v5p-N`` count
TensorCores, two per chip, so ``v5p-64`` is 32 chips (topology ``v5p:2x4x4``) and ``v5p-128`` is the
``v5p:4x4x4`` cube. :func:`topology_name` maps a product name to the topology string that
``jax.experimental.topologies.get_topology_desc`` takes.

GPUs (:data:`GPUS`, keyed by the CUDA device name that ``jax.Device.device_kind`` reports). Dense
bf16 tensor-core peaks from NVIDIA's A100, H100, H200 and L4 datasheets (which also quote twice
these figures, with 2:4 structured sparsity); memory in GiB (what the cards' names call GB):

=======================  =====================  ==================  ====================
``device_kind``          peak bf16 (TFLOP/s)    memory bandwidth    memory (GiB)
=======================  =====================  ==================  ====================
NVIDIA A100-SXM4-40GB    312                    1,555 GB/s          40
NVIDIA A100-PCIE-40GB    312                    1,555 GB/s          40
NVIDIA A100-SXM4-80GB    312                    2,039 GB/s          80
NVIDIA A100 80GB PCIe    312                    1,935 GB/s          80
NVIDIA H100 80GB HBM3    989                    3,350 GB/s          80 (the SXM5 card)
NVIDIA H100 PCIe         756                    2,000 GB/s          80
NVIDIA H100 NVL          835                    3,900 GB/s          94
NVIDIA H200              989                    4,800 GB/s          141 (the SXM card)
NVIDIA L4                121                    300 GB/s (GDDR6)    24
=======================  =====================  ==================  ====================

Only the exact names match: another card (or a name a driver spells differently) gets no MFU,
never a neighbour's peak. The AOT pre-flight compiles for TPUs only; these rows serve
:func:`chip_of_device_kind`.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One accelerator chip: a TPU generation or a GPU model.

    name: "v5e", "H100 SXM", ...; device_kind: what ``jax.Device.device_kind`` says for it.
    peak_bf16_flops: FLOP/s; hbm_bandwidth: bytes/s; hbm_bytes: bytes (all per chip).
    """

    name: str
    device_kind: str
    peak_bf16_flops: float
    hbm_bandwidth: float
    hbm_bytes: int


CHIPS: dict[str, ChipSpec] = {
    "v4": ChipSpec("v4", "TPU v4", 275e12, 1200e9, 32 * GIB),
    "v5e": ChipSpec("v5e", "TPU v5 lite", 197e12, 819e9, 16 * GIB),
    "v5p": ChipSpec("v5p", "TPU v5", 459e12, 2765e9, 95 * GIB),
    "v6e": ChipSpec("v6e", "TPU v6 lite", 918e12, 1640e9, 32 * GIB),
}

#: NVIDIA GPUs by ``device_kind`` (module docstring). Not topologies: :func:`chip_of` and
#: :func:`topology_name` take TPU names only.
GPUS: dict[str, ChipSpec] = {c.device_kind: c for c in (
    ChipSpec("A100 SXM 40GB", "NVIDIA A100-SXM4-40GB", 312e12, 1555e9, 40 * GIB),
    ChipSpec("A100 PCIe 40GB", "NVIDIA A100-PCIE-40GB", 312e12, 1555e9, 40 * GIB),
    ChipSpec("A100 SXM 80GB", "NVIDIA A100-SXM4-80GB", 312e12, 2039e9, 80 * GIB),
    ChipSpec("A100 PCIe 80GB", "NVIDIA A100 80GB PCIe", 312e12, 1935e9, 80 * GIB),
    ChipSpec("H100 SXM", "NVIDIA H100 80GB HBM3", 989e12, 3350e9, 80 * GIB),
    ChipSpec("H100 PCIe", "NVIDIA H100 PCIe", 756e12, 2000e9, 80 * GIB),
    ChipSpec("H100 NVL", "NVIDIA H100 NVL", 835e12, 3900e9, 94 * GIB),
    ChipSpec("H200", "NVIDIA H200", 989e12, 4800e9, 141 * GIB),
    ChipSpec("L4", "NVIDIA L4", 121e12, 300e9, 24 * GIB),
)}

#: Rows of one bf16 tile in TPU memory (8 sublanes of two packed rows; f32 tiles are 8 x 128).
BF16_TILE_ROWS = 16


def whole_tiles_per_chip(hidden: int, fsdp: int) -> bool:
    """Whether FSDP over ``fsdp`` chips leaves each chip an even share of the ``hidden`` rows that
    is a multiple of :data:`BF16_TILE_ROWS`."""
    return hidden % fsdp == 0 and (hidden // fsdp) % BF16_TILE_ROWS == 0


def fsdp_tile_warning(hidden: int, fsdp: int) -> Optional[str]:
    """A pre-flight hint when FSDP over ``fsdp`` chips leaves each chip a share of the
    ``hidden`` dimension that is not whole bf16 tiles (``hidden / fsdp`` not a multiple of
    :data:`BF16_TILE_ROWS`), else None.

    Weights sharded on their hidden axis are gathered for each use; with a partial tile per chip
    the gathered buffer is padded and copied. Qwen3-4B + MTP on v5e-256 (10 rows per chip) needed
    15.0 GiB per chip with FSDP over all 256 chips and 13.1 GiB over 32 (docs/TPU.md, "FSDP
    width").
    """
    if fsdp <= 1 or hidden % fsdp or whole_tiles_per_chip(hidden, fsdp):
        return None
    return (f"FSDP over {fsdp} chips leaves {hidden // fsdp} of the {hidden} hidden rows per "
            f"chip, not a multiple of {BF16_TILE_ROWS} (a bf16 TPU tile): gathered weights are "
            f"padded and copied. A narrower fsdp axis with the rest on `data` (e.g. "
            f"experiments/configs/tpu_pod.py's fsdp_width) may need less memory "
            f"(docs/TPU.md, \"FSDP width\").")


# Topologies of common slices (product name -> topology string).
_SQUARE = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_CUBE = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
         256: "4x8x8", 512: "8x8x8"}


def topology_name(name: str) -> str:
    """``"v5e-8" -> "v5e:2x4"``, ``"v5p-64" -> "v5p:2x4x4"``; a topology string is returned as is.

    Raises:
      ValueError for an unknown generation or a slice size without a standard topology.
    """
    if ":" in name:
        chip_of(name)
        return name
    m = re.fullmatch(r"(v4|v5e|v5p|v6e)-(\d+)", name)
    if not m:
        raise ValueError(f"unknown TPU slice {name!r}: want e.g. 'v5e-8', 'v5p-64' or a topology "
                         f"such as 'v5p:4x4x4'")
    gen, n = m.group(1), int(m.group(2))
    chips = n // 2 if gen in ("v4", "v5p") else n
    table = _CUBE if gen in ("v4", "v5p") else _SQUARE
    if chips not in table or (gen in ("v4", "v5p") and n % 2):
        raise ValueError(f"{name!r}: no standard topology for {chips} {gen} chips; pass a "
                         f"topology string such as '{gen}:{next(iter(table.values()))}'")
    return f"{gen}:{table[chips]}"


def chip_of_device_kind(kind: str) -> Optional[ChipSpec]:
    """The :class:`ChipSpec` whose ``device_kind`` is ``kind`` (``jax.Device.device_kind``, e.g.
    "TPU v5 lite" or "NVIDIA H100 80GB HBM3"); ``None`` for any other device (a CPU, a TPU
    generation or GPU model not listed)."""
    tpu = next((c for c in CHIPS.values() if c.device_kind == kind), None)
    return tpu if tpu is not None else GPUS.get(kind)


def chip_of(topology: str) -> ChipSpec:
    """The :class:`ChipSpec` of a topology string (``"v5e:2x2"``) or slice name (``"v5e-8"``)."""
    gen = re.split(r"[:\-]", topology, maxsplit=1)[0]
    if gen not in CHIPS:
        raise ValueError(f"unknown TPU generation {gen!r} in {topology!r}; known: {sorted(CHIPS)}")
    return CHIPS[gen]


def num_chips(topology: str) -> int:
    """Chips in a topology string (``"v5p:2x4x4" -> 32``)."""
    dims = topology_name(topology).split(":", 1)[1]
    return math.prod(int(x) for x in dims.split("x"))
