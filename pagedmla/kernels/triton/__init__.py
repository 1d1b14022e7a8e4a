"""pagedmla's Triton and Gluon kernels, one family per module (``pagedmla.ops.triton_provider`` registers
them as the `triton` provider). Importing the package makes the interpreter usable for them on CPU."""

from pagedmla.device import triton_interpreting


def _interpreter_scalar_index_fix() -> None:
    """Let Triton 3.6's interpreter (TRITON_INTERPRET=1, the CPU path) use loaded scalars as loop bounds.

    The interpreter holds every scalar as a 1-element array and turns loop bounds into ints with
    ``int(array)``, which NumPy >= 2.4 rejects for arrays with ndim > 0 (triton-lang/triton#9171, fixed
    upstream by #9172, not in 3.6). The kernels' loop bounds come from metadata and lengths, so without
    this the CPU path cannot run. Compiled kernels are unaffected.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_pagedmla_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagedmla_fixed = True
    interpreter._patch_lang_tensor = patched


if triton_interpreting():
    _interpreter_scalar_index_fix()
