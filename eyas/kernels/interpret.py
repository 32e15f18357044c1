"""Whether the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1: on the CPU, as in CI).

The kernels ask it where the interpreter differs from a GPU: its bf16 `tl.dot` is wrong (numpy has no bf16), so
tiles are upcast to float32 first; programmatic dependent launch is skipped (`pdl_launch`, `gdc_prologue`); and it
has no libdevice, where the GPU's own float32 `/`, `exp` and `log` are approximations: kernels that must round as
PyTorch does take `PRECISE=not interpreting()` and the `*_rn` helpers below (libdevice on the GPU, numpy's correctly
rounded operations in the interpreter)."""
import triton
import triton.language as tl
from triton.language.extra import libdevice


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def pdl_launch(pdl: bool) -> tuple[bool, dict]:
    """(USE_GDC for a kernel, its launch keywords): programmatic dependent launch where asked, not under the
    interpreter."""
    use = bool(pdl and not interpreting())
    return use, ({"launch_pdl": True} if use else {})


def pdl_on(switch: bool, device) -> tuple[bool, dict]:
    """`pdl_launch` for a kernel whose module switch asks for PDL: taken only on a GPU that has it (sm_90 or newer,
    `eyas.models.one_row.use_pdl`), so that older GPUs never get the launch attribute or its instructions."""
    if not switch:
        return False, {}
    from eyas.models.one_row import use_pdl
    return pdl_launch(use_pdl(device))


@triton.jit
def gdc_prologue(USE_GDC: tl.constexpr):
    """With PDL: let the next kernel's programs launch now, then wait for the previous kernel (its writes visible)."""
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def div_rn(x, y, PRECISE: tl.constexpr):
    """x / y rounded as IEEE rounds it (Triton's float32 `/` is an approximate division on the GPU)."""
    if PRECISE:
        return libdevice.div_rn(x, y)
    else:
        return x / y


@triton.jit
def exp_rn(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log_rn(x, PRECISE: tl.constexpr):
    """log(x) to an ulp: `tl.log`'s error is absolute (2^-22 near 1), far above a small result's ulp."""
    if PRECISE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def neg_log1p_neg_rn(v, PRECISE: tl.constexpr):
    """-log(1 - v) to an ulp, for v whose 1 - v is exact (the interpreter computes it so)."""
    if PRECISE:
        return -libdevice.log1p(-v)
    else:
        return -tl.log(1.0 - v)
