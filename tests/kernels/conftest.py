import os

# Must be set before triton.jit decorates the kernels, i.e. before radixrt.kernels is imported.
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


def _fix_interpreter_scalar_index() -> None:
    """Triton <= 3.6's interpreter turns loop bounds into ints with int(1-element array), which
    numpy >= 2.4 rejects (triton-lang/triton#9171); this breaks any `range(0, runtime_len, BLOCK)`."""
    try:
        int(np.array([1]))
        return
    except TypeError:
        pass
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_lang_tensor


_fix_interpreter_scalar_index()
