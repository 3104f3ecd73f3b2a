"""The kernels run under Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``
before transformers imports Triton). Not collected where Triton is not installed (it is in the ``test`` extra)."""

import importlib.util

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from hf_asymkv.kernels.interpreter import prepare_interpreter

    prepare_interpreter()
