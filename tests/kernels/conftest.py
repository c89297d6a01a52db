# TRITON_INTERPRET is set by the top-level conftest, before anything imports a kernel.
import numpy as np
from triton.runtime import interpreter


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
