"""GPU kernels: a Triton decode attention that reads the quantized cache's codes as stored.

- :mod:`.regions`: what the kernel reads, as plain tensors (:class:`~.regions.StoredCodes`, a quantized region,
  exact segments) and :func:`~.regions.unsupported` (what it cannot serve);
- :mod:`.backend`: ``HF_ASYMKV_ATTENTION_BACKEND`` (``auto``/``triton``/``torch``) and the choice per call;
- :mod:`.decode`: the launcher (:func:`~.decode.decode_attention`), and :mod:`.triton_decode`: the kernels.
  Both import Triton (an optional dependency: ``pip install "hf-asymkv[gpu]"``).

This package depends on no other part of hf_asymkv: the core translates its layers' storage into these plain
regions (:mod:`hf_asymkv.core.backend`). Importing it imports nothing heavy.
"""

__all__: list[str] = []
