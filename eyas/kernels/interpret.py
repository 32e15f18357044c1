"""Whether the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1: on the CPU, as in CI).

The kernels ask it where the interpreter differs from a GPU: its bf16 `tl.dot` is wrong (numpy has no bf16), so
tiles are upcast to float32 first; programmatic dependent launch is skipped."""
import triton


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)
