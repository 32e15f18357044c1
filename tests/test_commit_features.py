"""`eyas.kernels.commit_features`: the accepted path's features into the draft's hidden-state buffer in one launch,
held to `eyas.spec.step.commit_features_reference` (what `spec_step` runs without it: the draft's own
`read_features`), interpreted on the CPU and compiled on a GPU; which drafts take it; and the engine with
`eyas.spec.step.FUSED_FEATURE_COMMIT` on (in tests/test_feature_layers.py)."""
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # before Triton is first imported
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eyas.kernels.commit_features import commit_features_reference, commit_features_triton  # noqa: E402
from eyas.models.eagle import EagleDraft  # noqa: E402
from eyas.spec.step import fused_commit_weight  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _draft(F: int, H: int, dtype, g, feature_layers=True):
    """What `read_features` reads of a draft: its feature layers and `fuse` (EagleDraft's own method runs)."""
    d = SimpleNamespace(feature_layers=None)
    d.read_features = lambda f: EagleDraft.read_features(d, f)
    if not feature_layers:
        return d, None
    fuse = torch.nn.Linear(F, H, bias=False)
    with torch.no_grad():
        fuse.weight.copy_(torch.randn(H, F, generator=g) / F ** 0.5)
    d.feature_layers, d.fuse = (0,), fuse.to(DEV, dtype)
    return d, d.fuse.weight


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 4), N1=st.integers(1, 9), D1=st.integers(1, 6), H=st.sampled_from([8, 48, 100, 576]),
       k=st.integers(0, 3), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_commit_features_equal_the_reference(B, N1, D1, H, k, dtype, seed):
    """k feature layers (k = 0: an EAGLE-1 draft, the rows themselves); paths -1 past random depths, rows of the
    buffer in random order (slots), and the buffer's other rows untouched."""
    g = torch.Generator().manual_seed(seed)
    F = (k + 1) * H
    d, weight = _draft(F, H, dtype, g, feature_layers=k > 0)
    feats = torch.randn(B, N1, F, generator=g).to(dtype).to(DEV)
    path = torch.randint(0, N1, (B, D1), generator=g)
    depth = torch.randint(1, D1 + 1, (B,), generator=g)
    path[torch.arange(D1)[None, :] >= depth[:, None]] = -1  # past the accepted depth (the root, column 0, always)
    path = path.to(DEV)
    S, R = B + 3, D1 + 2
    slots = torch.randperm(S, generator=g)[:B].to(DEV)
    got = torch.full((S, R, H), float("nan"), dtype=dtype, device=DEV)
    want = got.clone()
    commit_features_triton(feats, path, weight, slots, got)
    commit_features_reference(d, feats, path, want, slots)
    written = torch.zeros(S, R, dtype=torch.bool)
    written[slots.cpu(), :D1] = True
    assert torch.isnan(got[~written.to(DEV)]).all()  # nothing else written
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # bf16: products summed in another order
    if k == 0:
        assert torch.equal(got[written.to(DEV)], want[written.to(DEV)])  # a copy
    else:
        torch.testing.assert_close(got[written.to(DEV)], want[written.to(DEV)], **tol)


def test_commit_features_refuse_bad_shapes():
    feats = torch.zeros(2, 5, 12, device=DEV)
    path = torch.zeros(2, 3, dtype=torch.long, device=DEV)
    slots = torch.arange(2, device=DEV)
    with pytest.raises(ValueError, match=r"must be \[H, 12\]"):
        commit_features_triton(feats, path, torch.zeros(4, 8, device=DEV), slots, torch.zeros(2, 4, 4, device=DEV))
    with pytest.raises(ValueError, match="dst"):
        commit_features_triton(feats, path, None, slots, torch.zeros(2, 2, 12, device=DEV))  # fewer rows than D1
    with pytest.raises(ValueError, match="slots"):
        commit_features_triton(feats, path, None, slots[:1], torch.zeros(2, 4, 12, device=DEV))


def test_which_drafts_take_the_launch():
    """EAGLE-1 (the identity) and a plain bias-free `fuse` take it; a `fuse` with a bias, or of another kind (an FP8
    or sharded linear), keeps the reference."""
    assert fused_commit_weight(SimpleNamespace(feature_layers=None)) == (True, None)
    fuse = torch.nn.Linear(8, 4, bias=False)
    assert fused_commit_weight(SimpleNamespace(feature_layers=(0,), fuse=fuse)) == (True, fuse.weight)
    assert fused_commit_weight(SimpleNamespace(feature_layers=(0,), fuse=torch.nn.Linear(8, 4)))[0] is False

    class Other(torch.nn.Linear):
        pass
    assert fused_commit_weight(SimpleNamespace(feature_layers=(0,), fuse=Other(8, 4, bias=False)))[0] is False
