"""Triton helpers both relaxation kernels share: loading a padded tile, an exact product, and one step of the hidden
chain h_1..h_M (M = 1, 2 or 3) with the box clamp, Jacobi or in even/odd halves. Imported only once triton is (see
kernels/backend.py)."""

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def load_tile(ptr, stride, n_rows, n_cols, PR: tl.constexpr, PC: tl.constexpr):
    """A (PR, PC) tile of a row-major matrix (n_rows, n_cols) with row stride `stride`, zero outside it."""
    r, c = tl.arange(0, PR), tl.arange(0, PC)
    inside = (r[:, None] < n_rows) & (c[None, :] < n_cols)
    return tl.load(ptr + r[:, None] * stride + c[None, :], mask=inside, other=0.0)


@triton.jit
def load_rows(ptr, rows, n_rows, n_cols, PC: tl.constexpr):
    """Rows `rows` (BR,) of a contiguous (n_rows, n_cols) matrix as a (BR, PC) tile, zero outside it."""
    c = tl.arange(0, PC)
    inside = (rows[:, None] < n_rows) & (c[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * n_cols + c[None, :], mask=inside, other=0.0)


@triton.jit
def store_rows(ptr, x, rows, n_rows, n_cols, PC: tl.constexpr):
    c = tl.arange(0, PC)
    tl.store(ptr + rows[:, None] * n_cols + c[None, :], x, mask=(rows[:, None] < n_rows) & (c[None, :] < n_cols))


@triton.jit
def load_vec(ptr, n, P: tl.constexpr):
    c = tl.arange(0, P)
    return tl.load(ptr + c, mask=c < n, other=0.0)


@triton.jit
def mm(a, b):
    """a @ b in the inputs' precision: "ieee" keeps float32 exact (the default would round to TF32 on the GPU)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def sqrt_ieee(x):
    """The IEEE-rounded square root, as torch's: float32's tl.sqrt may compile to a faster approximation on the GPU
    (sqrt_rn is float32 only; float64's sqrt is exact)."""
    if x.dtype == tl.float32:
        r = tl.sqrt_rn(x)
    else:
        r = tl.sqrt(x)
    return r


@triton.jit
def div_ieee(a, b):
    """a / b rounded as IEEE division (and torch) round it: float32's `/` may compile to an approximation."""
    if b.dtype == tl.float32:
        r = tl.div_rn(a, b)
    else:
        r = a / b
    return r


@triton.jit
def box(x):
    return tl.minimum(tl.maximum(x, 0.0), 1.0)


@triton.jit
def load_chain(
    h1_ptr,
    h2_ptr,
    h3_ptr,
    q_ptr,
    wo_ptr,
    b2_ptr,
    b3_ptr,
    bo_ptr,
    r,
    rows,
    H1,
    H2,
    H3,
    N,
    HM,
    P1: tl.constexpr,
    P2: tl.constexpr,
    P3: tl.constexpr,
    PM: tl.constexpr,
    NP: tl.constexpr,
):
    """Rows r (of `rows`) of the state h_1..h_3 and q, and the chain's constants: W_out (NP, PM), b_out, b_2, b_3.
    Layers a shallower chain lacks come from its stand-ins and are never used."""
    h1 = load_rows(h1_ptr, r, rows, H1, P1)
    h2 = load_rows(h2_ptr, r, rows, H2, P2)
    h3 = load_rows(h3_ptr, r, rows, H3, P3)
    q = load_rows(q_ptr, r, rows, N, NP)
    wo = load_tile(wo_ptr, HM, N, HM, NP, PM)  # (n, H_M)
    bo = load_vec(bo_ptr, N, NP)
    b2 = load_vec(b2_ptr, H2, P2)
    b3 = load_vec(b3_ptr, H3, P3)
    return h1, h2, h3, q, wo, bo, b2, b3


@triton.jit
def store_chain(
    h1_ptr,
    h2_ptr,
    h3_ptr,
    q_ptr,
    h1,
    h2,
    h3,
    q,
    r,
    rows,
    H1,
    H2,
    H3,
    N,
    DEPTH: tl.constexpr,
    P1: tl.constexpr,
    P2: tl.constexpr,
    P3: tl.constexpr,
    NP: tl.constexpr,
):
    """The relaxed rows back into the state: every layer the chain has, and q."""
    store_rows(h1_ptr, h1, r, rows, H1, P1)
    if DEPTH >= 2:
        store_rows(h2_ptr, h2, r, rows, H2, P2)
    if DEPTH >= 3:
        store_rows(h3_ptr, h3, r, rows, H3, P3)
    store_rows(q_ptr, q, r, rows, N, NP)


@triton.jit
def load_couplings(
    w2_ptr, w3_ptr, wo, H1, H2, H3, DEPTH: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr
):
    """The hidden-to-hidden couplings W_2 (P2, P1) and W_3 (P3, P2) a chain of DEPTH layers has; wo stands in for
    the others (never read)."""
    if DEPTH >= 2:
        w2 = load_tile(w2_ptr, H1, H2, H1, P2, P1)
    else:
        w2 = wo
    if DEPTH >= 3:
        w3 = load_tile(w3_ptr, H2, H3, H2, P3, P2)
    else:
        w3 = wo
    return w2, w3


@triton.jit
def top_layer(h1, h2, h3, DEPTH: tl.constexpr):
    """h_M, the hidden layer q couples to."""
    if DEPTH == 1:
        top = h1
    elif DEPTH == 2:
        top = h2
    else:
        top = h3
    return top


@triton.jit
def hidden_step(h1, h2, h3, q, drive, w2, w3, wo, b2, b3, DEPTH: tl.constexpr):
    """One Jacobi step of the hidden layers from the old state (what fixed_point_steps does per step):
    h_i <- box(W_i h_{i-1} + b_i + W_{i+1}^T h_{i+1}), h_0's term being `drive` and h_{M+1} = q. Tiles: h_i (BR, P_i),
    w2 (P2, P1), w3 (P3, P2), wo (NP, P_M), b2 (P2,), b3 (P3,); unused layers pass through untouched."""
    if DEPTH == 1:
        n1 = box(drive + mm(q, wo))
        n2 = h2
        n3 = h3
    elif DEPTH == 2:
        n1 = box(drive + mm(h2, w2))
        n2 = box(b2[None, :] + mm(h1, tl.trans(w2)) + mm(q, wo))
        n3 = h3
    else:
        n1 = box(drive + mm(h2, w2))
        n2 = box(b2[None, :] + mm(h1, tl.trans(w2)) + mm(h3, w3))
        n3 = box(b3[None, :] + mm(h2, tl.trans(w3)) + mm(q, wo))
    return n1, n2, n3


@triton.jit
def odd_half(h1, h2, h3, q, drive, w2, w3, wo, b3, DEPTH: tl.constexpr):
    """The first half of an even/odd step (what even_odd_steps does): the odd hidden layers h_1 and h_3 from their
    neighbours, h_2 and q as they are. q = h_{M+1} is odd too for DEPTH 2; its step is the caller's."""
    if DEPTH == 1:
        n1 = box(drive + mm(q, wo))
        n3 = h3
    elif DEPTH == 2:
        n1 = box(drive + mm(h2, w2))
        n3 = h3
    else:
        n1 = box(drive + mm(h2, w2))
        n3 = box(b3[None, :] + mm(h2, tl.trans(w3)) + mm(q, wo))
    return n1, n3


@triton.jit
def even_half(h1, h2, h3, q, w2, w3, wo, b2, DEPTH: tl.constexpr):
    """The second half: h_2 (DEPTH 2 and 3) from the new h_1 and h_3, or the new q for DEPTH 2; q = h_{M+1} is even
    for DEPTH 1 and 3, and its step is the caller's (after this half, from the new h_M)."""
    if DEPTH == 1:
        n2 = h2
    elif DEPTH == 2:
        n2 = box(b2[None, :] + mm(h1, tl.trans(w2)) + mm(q, wo))
    else:
        n2 = box(b2[None, :] + mm(h1, tl.trans(w2)) + mm(h3, w3))
    return n2


@triton.jit
def speed(v, lt, c_eps):
    """spd = |v L^T, sqrt(eps)| (BR,) of the velocities v (BR, NP); lt is the (NP, NP) tile of L^T, c_eps the
    square root of eps."""
    z = mm(v, lt)
    return sqrt_ieee(tl.sum(z * z, axis=1) + c_eps * c_eps)


BLOCK_ROWS = 16  # batch rows per program: rows relax independently, and tl.dot wants every dimension >= 16


def warps(widest: int) -> int:
    """Warps per program for the widest padded tile: more threads share the registers of a wider layer (1024: 16)."""
    return 4 if widest <= 256 else 8 if widest <= 512 else 16


def padded(size: int) -> int:
    """The tile size for a dimension: a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, triton.next_power_of_2(size))


def row_major(*tensors) -> None:
    """The kernels address row r of a matrix at r * width (or its row stride) and columns at unit stride: refuse any
    other layout (a transposed or sliced view) rather than read the wrong numbers. Metadata only, no tensor work."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(
                f"Triton kernel: a tensor of shape {tuple(t.shape)} and strides {t.stride()} is not "
                "contiguous; the kernels need row-major tensors (the workspace and the readout allocate them so)"
            )


def sized(dtype: torch.dtype, **named: tuple[Tensor, tuple[int, ...]]) -> None:
    """The kernels read exactly the sizes they were built for, unchecked: refuse a tensor of another shape or dtype
    (named by its argument) rather than read past its end. Metadata only, no tensor work."""
    for name, (t, shape) in named.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"Triton kernel: {name} has shape {tuple(t.shape)} and dtype {t.dtype}; it was built for {shape} "
                f"and {dtype}"
            )


def hidden_slots(layers: list[Tensor]) -> list[Tensor]:
    """The kernels' three hidden-layer arguments from a state's layers (h_1 .. h_M, q): h_1 stands in for the layers a
    shallower chain lacks (never read: DEPTH is a constexpr)."""
    return layers[:-1] + [layers[0]] * (4 - len(layers))


def chain_args(ws, params) -> dict:
    """The kernel arguments of the hidden chain and q for a workspace: the state tensors, drive, couplings, their
    sizes and tiles. Layers a shallower chain lacks are stood in for by h_1 (never read: DEPTH is a constexpr)."""
    s, w, b = ws.state.s, params.weights, params.biases
    row_major(*s, ws.drive, *w, *b, ws.q_hist, ws.spd_hist)
    depth = len(s) - 1
    h = hidden_slots(s)
    w23 = w[1:depth] + [w[0]] * (3 - depth)
    b23 = b[1:depth] + [b[0]] * (3 - depth)
    sizes = [t.shape[1] for t in h]
    n = s[-1].shape[1]
    return dict(
        h1_ptr=h[0],
        h2_ptr=h[1],
        h3_ptr=h[2],
        q_ptr=s[-1],
        drive_ptr=ws.drive,
        w2_ptr=w23[0],
        w3_ptr=w23[1],
        wo_ptr=w[depth],
        b2_ptr=b23[0],
        b3_ptr=b23[1],
        bo_ptr=b[depth],
        rows=ws.drive.shape[0],
        H1=sizes[0],
        H2=sizes[1],
        H3=sizes[2],
        N=n,
        HM=sizes[depth - 1],
        DEPTH=depth,
        BR=BLOCK_ROWS,
        P1=padded(sizes[0]),
        P2=padded(sizes[1]),
        P3=padded(sizes[2]),
        PM=padded(sizes[depth - 1]),
        NP=padded(n),
        num_warps=warps(max(padded(h) for h in sizes)),
    )
