"""Whether the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1: on the CPU, as in CI).

The kernels ask it where the interpreter differs from a GPU: its bf16 `tl.dot` is wrong (numpy has no bf16), so
tiles are upcast to float32 first; programmatic dependent launch is skipped (`pdl_launch`, `gdc_prologue`)."""
import triton
import triton.language as tl


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def pdl_launch(pdl: bool) -> tuple[bool, dict]:
    """(USE_GDC for a kernel, its launch keywords): programmatic dependent launch where asked, not under the
    interpreter."""
    use = bool(pdl and not interpreting())
    return use, ({"launch_pdl": True} if use else {})


@triton.jit
def gdc_prologue(USE_GDC: tl.constexpr):
    """With PDL: let the next kernel's programs launch now, then wait for the previous kernel (its writes visible)."""
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
