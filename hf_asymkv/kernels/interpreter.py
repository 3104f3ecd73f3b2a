"""Running the kernels on CPU tensors with Triton's interpreter (``TRITON_INTERPRET=1``): what tests and
``scripts/gpu_check.py --dry-run`` call before the first launch.

Triton's interpreter up to 3.6 turns a scalar into an integer with ``int(array)``, which numpy 2.4 refuses for
the one-element arrays the interpreter keeps scalars in, so every ``range()`` over a kernel argument fails with
"only 0-dimensional arrays can be converted to Python scalars" (triton-lang/triton issue 9171, fixed upstream by
PR 9172 for later releases). :func:`prepare_interpreter` applies the same one-line fix to an affected
interpreter, explicitly and only then.
"""

from __future__ import annotations

import os

__all__ = ["prepare_interpreter"]


def _needs_index_fix() -> bool:
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int32))
    except TypeError:
        pass
    else:
        return False  # numpy < 2.4 still converts one-element arrays
    import inspect

    from triton.runtime import interpreter

    return "int(self.handle.data)" in inspect.getsource(interpreter._patch_lang_tensor)


def prepare_interpreter() -> None:
    """Select Triton's interpreter (``TRITON_INTERPRET=1``) and make it work with numpy >= 2.4.

    Call it before the kernels are imported: Triton reads ``TRITON_INTERPRET`` when a kernel is defined.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    if not _needs_index_fix():
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor
