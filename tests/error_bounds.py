"""Error bounds of a kernel's result against the float64 reference, for every test (CPU and GPU).

A whole-tensor norm alone lets one wrong row through: a fully wrong row of a 3.1M-element dQ moves
||err|| / ||ref|| by about 0.9%, under a 1e-2 bound. So a result must also be close row by row and head
by head:

- whole tensor: ||err|| / ||ref|| < tol;
- each head (the slices along `head_axis`): ||err_h|| / max(||ref_h||, typical head norm) < HEAD_FACTOR * tol;
- each row (the vectors along the last axis, or single elements with `rows="elements"`):
  ||err_r|| / max(||ref_r||, typical row norm) < ROW_FACTOR * tol.

The typical norm (the tensor's norm over the square root of the slice count) keeps slices whose reference
is near zero (fully masked rows, keys few queries see) from dividing by nothing. The factors leave room
for rounding, which is spread evenly (bf16 rows err by about 3e-3), and none for a wrong row or head
(an error about as large as the values). NaN in the result (an unwritten element, when outputs are
poisoned) fails with its position; infinities equal in value and position count as equal.
"""
import numpy as np

TOL = 1e-2  # bf16 / fp16 inputs, fp32 accumulation
LSE_TOL = 1e-3
HEAD_FACTOR = 2
ROW_FACTOR = 5


def as_float64(x):
    """A float64 NumPy copy of a NumPy array, a torch tensor on any device, or any array NumPy reads."""
    if hasattr(x, "detach"):
        x = x.detach().to("cpu")
        return x.double().numpy()
    return np.asarray(x).astype(np.float64)


def _slice_errors(diff, ref, axis_first):
    """(error norm / max(reference norm, typical norm)) of each slice of `diff` (slices along the first
    axis of the arrays as reshaped by `axis_first`)."""
    d, r = axis_first(diff), axis_first(ref)
    d, r = d.reshape(d.shape[0], -1), r.reshape(r.shape[0], -1)
    typical = np.linalg.norm(r) / np.sqrt(max(r.shape[0], 1))
    floor = max(typical, np.finfo(np.float64).tiny)
    return np.linalg.norm(d, axis=1) / np.maximum(np.linalg.norm(r, axis=1), floor)


def errors(got, want, head_axis=-2, rows="vectors"):
    """(whole, worst head, that head's index, worst row, that row's index) relative errors."""
    same_inf = np.isinf(got) & (got == want)
    diff = np.subtract(got, want, out=np.zeros_like(got), where=~same_inf)
    ref = np.where(same_inf, 0.0, want)
    whole = np.linalg.norm(diff) / max(np.linalg.norm(ref), np.finfo(np.float64).tiny)
    heads = _slice_errors(diff, ref, lambda a: np.moveaxis(a, head_axis, 0))
    if rows == "elements":
        row_errors = _slice_errors(diff.reshape(-1, 1), ref.reshape(-1, 1), lambda a: a)
        row_shape = diff.shape
    else:
        row_errors = _slice_errors(diff, ref, lambda a: a.reshape(-1, a.shape[-1]))
        row_shape = diff.shape[:-1]
    worst_head, worst_row = int(np.argmax(heads)), int(np.argmax(row_errors))
    return (whole, heads[worst_head], worst_head, row_errors[worst_row],
            tuple(int(i) for i in np.unravel_index(worst_row, row_shape)))


def assert_close(name, got, want, tol=TOL, head_axis=-2, rows="vectors"):
    """Fail unless `got` matches the float64 `want` as a whole, per head and per row (see the module).

    head_axis: where the heads are ([.., H, D] outputs and gradients, [B, H, S] and [H, T] LSE: -2;
    dbias [B, H, Sq, Sk]: -3). rows: 'vectors' (along the last axis) or 'elements' (LSE)."""
    got, want = as_float64(got), as_float64(want)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, reference {want.shape}"
    nan = np.isnan(got) & ~np.isnan(want)
    assert not nan.any(), (f"{name}: {int(nan.sum())} NaN elements (unwritten or invalid), first at "
                           f"{np.argwhere(nan)[0].tolist()}")
    whole, head, head_index, row, row_index = errors(got, want, head_axis, rows)
    assert whole < tol, f"{name}: relative error {whole:.2e} >= {tol}"
    assert head < HEAD_FACTOR * tol, f"{name}: head {head_index} has relative error {head:.2e} >= {HEAD_FACTOR * tol}"
    assert row < ROW_FACTOR * tol, f"{name}: row {row_index} has relative error {row:.2e} >= {ROW_FACTOR * tol}"


def assert_lse_close(name, got, want, tol=LSE_TOL):
    """LSE ([B, H, S] or [H, T]): every element is a row."""
    assert_close(name, got, want, tol, head_axis=-2, rows="elements")
